"""The draft's view of the LM head: which tokens it may propose, and how a row picks one.

Shared by the model drafts (`model.py`) and the head draft (`head.py`). Both end in the target's
LM head (an early exit and a head share it; a separate model has its own), and both may restrict
it to the tokens recent traffic used (`restrict`), which makes a draft step much cheaper.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F

from adaptive_spec.drafters import DraftRow
from adaptive_spec.kernels import cpu_linear, exact
from adaptive_spec.sample.sampling import logits_to_probs, sample


class DraftVocab:
    """`lm_head`'s rows are the target's tokens `row_ids` ([rows] int64, rising), or with None the whole vocabulary
    in order (the target's own LM head). An EAGLE-3 head has an LM head of its own over a draft vocabulary of fixed
    size (`Eagle3Head.draft_ids`: what its checkpoint's d2t maps), and proposes only those tokens."""

    def __init__(self, lm_head: torch.nn.Module, row_ids: torch.Tensor | None = None, full_size: int | None = None):
        self.lm_head = lm_head
        self.weight = cast(torch.Tensor, lm_head.weight)  # [rows, hidden]
        self.full_size = int(self.weight.shape[0] if full_size is None else full_size)  # the target's vocabulary
        self.row_ids = None if row_ids is None else row_ids.long().to(self.weight.device)  # [rows]
        self.ids: torch.Tensor | None = None  # [n_vocab] token ids the draft may propose; None = all
        self._rows: torch.Tensor | None = None  # [n_vocab, hidden] the LM head's rows for them
        self._id_list: list[int] | None = None  # ids, as Python numbers: a choice's token without a tensor op
        self.restrict(None)

    def restrict(self, token_ids) -> None:
        """Propose only these tokens (None: any the LM head has), computing just their rows of the LM head.

        The default model's head has 49152 rows, about a third of an `early-exit:4` step. Traffic
        of one kind uses far fewer tokens: restricted to the 1,200 a domain's records used, the
        head costs 1/40 of that. It stays lossless: the target still verifies every token, and a
        token outside the set is simply never proposed (under sampling, the draft's distribution
        is the restricted one, which rejection sampling corrects like any other). With `row_ids`, the
        tokens kept are those of the set that the LM head has.
        """
        if token_ids is None:
            self._rows = None
            self.ids = self.row_ids
            self._id_list = None if self.row_ids is None else self.row_ids.tolist()
            return
        device = self.weight.device
        ids = torch.as_tensor(sorted({int(t) for t in token_ids}), dtype=torch.long, device=device)
        if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= self.full_size:
            raise ValueError(f"a draft vocabulary must be non-empty ids in [0, {self.full_size})")
        if getattr(self.lm_head, "bias", None) is not None:
            raise ValueError("restricting the vocabulary needs an LM head without bias")
        rows = ids
        if self.row_ids is not None:  # the rows of those ids the head has
            at = torch.searchsorted(self.row_ids, ids).clamp_max(len(self.row_ids) - 1)
            held = self.row_ids[at] == ids
            if not bool(held.any()):
                raise ValueError("a draft vocabulary must share some ids with the draft's LM head")
            ids, rows = ids[held], at[held]
        self._rows = self.weight[rows].contiguous()
        self.ids, self._id_list = ids, ids.tolist()

    @property
    def restricted(self) -> bool:
        """Whether the draft proposes fewer tokens than the target has."""
        return self.ids is not None

    @property
    def rows(self) -> torch.Tensor:
        """[n_vocab, hidden]: the LM head's rows of the tokens the draft may propose. A plain tensor either way, not
        the head's Parameter (detached at each call, so its storage is the head's now): a compiled draft step takes
        it as an input and would compile again for the other type."""
        return self.weight.detach() if self._rows is None else self._rows

    @property
    def bias(self) -> torch.Tensor | None:
        return cast(torch.Tensor | None, getattr(self.lm_head, "bias", None))  # None when restricted

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """states: [..., hidden] after the final norm -> [..., n_vocab] (n_vocab = all when unrestricted)."""
        return draft_logits(states, self.rows, self.bias)

    def token(self, index: int) -> int:
        """The token id of column `index` of this vocabulary's logits."""
        return index if self._id_list is None else self._id_list[index]

    def choose(self, logits: torch.Tensor, row: DraftRow, drafted: list[int]) -> tuple[int | None, torch.Tensor | None]:
        """The token a row drafts from its logits [n_vocab] after `drafted`, and the full-vocabulary
        distribution it was drawn from (None for greedy rows, whose proposals are deterministic).
        A row with constraints (penalties, a grammar) drafts from its processed logits; when they
        leave no token of this vocabulary, the token is None and the row drafts no further.

        So does a row whose logits hold a NaN or a +inf (`_drawable`): a draft whose weights went bad
        would give NaN probabilities, and one `torch.multinomial` on them failed the whole batch
        step. Without a draft the row's step is the target's alone, which is exact either way."""
        if row.constraints is not None:
            logits = row.constraints.draft(logits, drafted, self.ids)
        if not bool(_drawable(logits)):
            return None, None
        if row.params.greedy:
            choice, probs = int(logits.argmax()), None
        else:
            restricted = logits_to_probs(logits[None], row.params)  # [1, n_vocab]
            choice = int(sample(restricted, row.generator)[0])
            probs = restricted[0]
            if self.ids is not None:
                probs = torch.zeros(self.full_size, dtype=probs.dtype, device=probs.device).index_copy_(
                    0, self.ids, probs
                )
        return self.token(choice), probs

    def choose_rows(
        self,
        logits: torch.Tensor,
        rows: list[DraftRow],
        drafted: list[list[int]],
        picks: list[int] | None = None,
    ) -> list[tuple[int | None, torch.Tensor | None]]:
        """`choose` for each row of logits [n, n_vocab]: the greedy rows without constraints all at once (their
        `greedy_picks`, read back together), the others one by one. One row's `choose` cost about 0.1 ms on
        the default model, most of it small operations and their reads back, paid per row and per draft
        token. `picks`: every row's `greedy_picks`, where the caller computed them with the logits (the
        head's compiled draft step does)."""
        plain = _plain(rows)
        chosen: list[tuple[int | None, torch.Tensor | None] | None] = [None] * len(rows)
        if plain:
            if picks is None:
                plain_picks = greedy_picks(logits if len(plain) == len(rows) else logits[plain]).tolist()
            else:
                plain_picks = [picks[j] for j in plain]
            for j, pick in zip(plain, plain_picks, strict=True):
                chosen[j] = (self.token(pick) if pick >= 0 else None, None)
        return [
            choice if choice is not None else self.choose(logits[j], rows[j], drafted[j])
            for j, choice in enumerate(chosen)
        ]

    def candidates_rows(
        self, logits: torch.Tensor, rows: list[DraftRow], paths: list[list[int]], count: int
    ) -> list[list[tuple[int, float]]]:
        """`candidates` for each row of logits [m, n_vocab] (a tree's nodes of one depth): the greedy rows without
        constraints all at once, one log-softmax, top-k and read back for all of them, the others one by one.
        A node's `candidates` alone cost about 0.085 ms on the default model, paid for every node a tree offers
        from (1 ms of a 28 ms step for trees of 8 nodes on an Intel Xeon)."""
        plain = _plain(rows)
        found: list[list[tuple[int, float]] | None] = [None] * len(rows)
        if plain:
            some = logits if len(plain) == len(rows) else logits[plain]  # [p, n_vocab]
            drawable = _drawable(some).tolist()
            best = torch.log_softmax(some.float(), dim=-1).topk(min(count, some.shape[-1]), dim=-1)
            for j, ok, values, indices in zip(
                plain, drawable, best.values.tolist(), best.indices.tolist(), strict=True
            ):
                found[j] = self._listed(values, indices) if ok else []
        return [
            nodes if nodes is not None else self.candidates(logits[j], rows[j], paths[j], count)
            for j, nodes in enumerate(found)
        ]

    def candidates(self, logits: torch.Tensor, row: DraftRow, path: list[int], count: int) -> list[tuple[int, float]]:
        """A tree's children after `path`: the `count` likeliest tokens of the row's processed draft
        distribution (its constraints and sampling parameters applied) with their log-probabilities,
        best first, as full-vocabulary ids; [] where nothing may be drawn. They are candidates, not
        samples: the target's tree rule (acceptance.tree_rejection_sample) keeps the output exact."""
        if row.constraints is not None:
            logits = row.constraints.draft(logits, path, self.ids)
        if not bool(_drawable(logits)):
            return []
        if row.params.greedy:
            logprobs = torch.log_softmax(logits.float(), dim=-1)
        else:
            logprobs = logits_to_probs(logits[None].float(), row.params)[0].log()
        best = logprobs.topk(min(count, logprobs.shape[0]))
        return self._listed(best.values.tolist(), best.indices.tolist())

    def _listed(self, values: list[float], indices: list[int]) -> list[tuple[int, float]]:
        """A top-k as candidates: (full-vocabulary id, log-probability), best first, the impossible ones left out."""
        return [(self.token(i), v) for v, i in zip(values, indices, strict=True) if v > -math.inf]


def _plain(rows: list[DraftRow]) -> list[int]:
    """The rows whose choice is their logits as they stand (greedy, no constraints): taken all at once."""
    return [j for j, row in enumerate(rows) if row.params.greedy and row.constraints is None]


def draft_logits(states: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """states [..., hidden] after the final norm -> logits over an LM head's `rows` [n_vocab, hidden] (DraftVocab.rows).

    In bf16 on a CPU where the compiled step's product kernel built (exact.COMPILED_LINEAR), a draft's few rows
    take that kernel, as its own layers do (`exact.draft_products`), and so does a compiled draft step: a draft
    need not be invariant, only fast. Measured on an Intel Xeon without AMX, one row: the whole 49152-row head
    2.15 -> 1.09 ms (an untrained head's every probe), 813 restricted rows 0.050 -> 0.012 ms. Otherwise the
    rule of the layers' linears (cpu_linear.install)."""
    fast = exact.kernel_product(states, rows, bias, draft=True)
    if fast is not None:
        return fast
    product = cpu_linear.skinny_linear if cpu_linear.applies(rows) else F.linear
    return product(states, rows, bias)


def greedy_picks(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., n_vocab] -> [...]: each row's argmax, or -1 where its logits name no distribution (`_drawable`)."""
    return torch.where(_drawable(logits), logits.argmax(-1), -1)


def _drawable(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., n_vocab] -> bool [...]: each row names a distribution: some token is finite, none is NaN or
    +inf (-inf is a masked token). The sum is NaN or +inf exactly when some logit is NaN or +inf (fp32: no
    overflow from finite logits), so two reductions decide it."""
    return torch.isfinite(logits).any(-1) & (logits.sum(-1, dtype=torch.float32) < math.inf)
