"""Drafters propose the next tokens of every row of a batch; the target verifies them.

A drafter subclasses `Drafter` (cf. transformers `candidate_generator.py`, vLLM `v1/spec_decode/`)
and has two verbs:

- `new_cache()` gives the per-batch state a drafter keeps between steps (a `BatchCache` for a
  model draft, None for prompt lookup). The batch adds, removes and copies its rows together
  with the target's;
- `propose(cache, rows, ks)` returns up to `ks[i]` tokens after `rows[i].ids` for each row.

Every other hook has a default that does nothing (free proposals, the target's hidden states
at prefill and commit, the cache rollback at commit, adapters): see `Drafter`. One file per
kind: `model.py` (a causal LM: a separate model or an early exit), `head.py` (EAGLE-style),
`ngram.py` (prompt lookup), `free_first.py` (free proposals first, then a model draft).

Each row brings its context (`ids`, whose last token is the pending one), its slot in the
caches (`slot`), its sampling parameters (`params`), its random generator (`generator`) and the
adapter it drafts with (`adapter`, an `AdapterSlot`, or None for the base draft). Rows with
different adapters share the batch: a drafter runs one forward per adapter present
(`by_adapter`).

Draft specs, as `Engine.from_pretrained(draft=...)` takes them, are parsed in `spec.py`:

- `early-exit:N`: the target's first N layers, final norm and LM head (see `early_exit.py`);
- `ngram` (or `ngram:N` for the longest n-gram tried): prompt lookup, no model;
- anything else: a separate model with the target's vocabulary, loaded by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from adaptive_spec.sample.sampling import SamplingParams

if TYPE_CHECKING:
    from adaptive_spec.drafters.slots import AdapterSlot
    from adaptive_spec.outputs.constraints import Constraints


@dataclass
class Proposal:
    tokens: torch.Tensor  # [n] int64, n <= k
    probs: torch.Tensor | None  # [n, vocab] the distribution each token was drawn from; None = deterministic
    forwards: int = 0  # draft model forward passes spent on this row
    # context tokens the first forward fed: what the row's last step emitted at most (a head feeds its accepted
    # tokens again, with the target's states), more to catch up after plain steps or on the prompt
    fed: int = 0
    free: bool = False  # copied from the context or an n-gram index (free_first.py), no model forward
    parents: list[int] | None = None  # a tree: token j follows token parents[j] (-1: the pending token); None: a chain
    forced: int = 0  # the chain's last tokens that the row's grammar forces (row.py `Row.forced_tail`), not the draft's
    # Once the target kept a path of a tree, the proposal is that path (batch.py `_accept`):
    verified: int | None = None  # the tree's size, every node of which the target verified
    depth: int | None = None  # the tree's depth: how far the path could have gone
    columns: list[int] | None = None  # the verify columns of the pending token and the path's nodes

    @property
    def drafted(self) -> int:
        """Tokens the target verified beyond the pending one: the tree's size, or the chain's length."""
        return self.verified if self.verified is not None else len(self.tokens)

    @property
    def reach(self) -> int:
        """Positions the draft could have been accepted at: the tree's depth, or the chain's length."""
        return self.depth if self.depth is not None else len(self.tokens)


def no_proposal(device: torch.device) -> Proposal:
    return Proposal(torch.zeros(0, dtype=torch.long, device=device), None)


class DraftRow(Protocol):
    slot: int  # the row's index in the batch's caches
    ids: list[int]  # the context; its last token is pending (not yet in the target's cache)
    params: SamplingParams
    generator: torch.Generator | None
    adapter: AdapterSlot | None  # the adapter the row drafts with; None = the base draft
    constraints: Constraints | None  # penalties, a grammar
    draft_state: Any  # what the drafter keeps per row (the head: the target's states); None until it sets it


def by_adapter(rows: Sequence[DraftRow], indices: list[int]) -> list[tuple[AdapterSlot | None, list[int]]]:
    """`indices` grouped by their row's adapter, in order of first appearance: [(adapter, [i, ...])]."""
    groups: dict[int, tuple[AdapterSlot | None, list[int]]] = {}
    for i in indices:
        adapter = rows[i].adapter
        groups.setdefault(id(adapter), (adapter, []))[1].append(i)
    return list(groups.values())


class Drafter:
    """What the loop (batch.py), the engine and the adapter watcher ask of a draft.

    A draft kind subclasses this and implements `propose`; every other hook has a default that
    does nothing, so the loop calls each hook on every drafter and never asks what kind it has.
    A new draft kind is one file in this package plus a line in `build.py` (its spec), and
    `spec.py` if it takes a new spec form; `batch.py` and `engine.py` stay as they are.

    The step calls, per batch: `propose` (draft), then after verify and accept, `on_commit` for
    each row. Rows join through `on_prefill` (or `on_copy_row` when they share a prompt).
    """

    name: str = "draft"
    wants_target_hidden: bool = False  # the target's hidden states reach on_prefill/on_commit
    takes_adapters: bool = False  # build_weights and new_vocab make adapter versions for it
    prior_cost: float = 0.3  # a draft forward over a row as a fraction of a target step, until measured

    def new_cache(self):
        """The per-batch state kept between steps (a kv.BatchCache for a model draft), or None.
        The batch adds, removes and copies its rows with the target's."""
        return None

    builds_trees: bool = False  # propose(depths=...) returns trees (Proposal.parents)

    def propose(
        self,
        cache,
        rows: Sequence[DraftRow],
        ks: list[int],
        free: list[list[int]] | None = None,
        depths: list[int] | None = None,
    ) -> list[Proposal]:
        """Up to ks[i] tokens after rows[i].ids for each row. `free[i]`, when given, is the row's free
        proposal that the policy chose to use (free_proposals). With `depths` (a draft that
        builds_trees), row i's proposal is a tree of at most ks[i] nodes and depths[i] levels."""
        raise NotImplementedError

    def free_proposals(self, rows: Sequence[DraftRow], limits: list[int]) -> list[list[int]] | None:
        """Proposals that cost no forward (copied from the context or an n-gram index), at most
        limits[i] tokens per row, [] where a row has none; None: this draft has no free source."""
        return None

    def on_prefill(self, row: DraftRow, hidden: torch.Tensor | None) -> None:
        """A row joined; `hidden` is the target's states at its prompt positions but the last
        ([len(ids) - 1, hidden]) when wants_target_hidden, else None."""

    def on_copy_row(self, source: DraftRow, row: DraftRow) -> None:
        """`row` shares `source`'s prompt and starts from a copy of its caches (OpenAI's n)."""

    def on_commit(self, cache, row: DraftRow, before: int, kept_hidden: torch.Tensor | None) -> None:
        """A step ended: the row's context grew from `before` tokens to len(row.ids). `kept_hidden`
        is the target's states at the positions it verified and kept ([kept, hidden]) when
        wants_target_hidden. By default the draft cache keeps what it computed up to the new
        pending token, since everything before it is now context."""
        if cache is not None:
            cache.set_length(row.slot, min(cache.lengths[row.slot], len(row.ids) - 1))

    def models(self) -> list[torch.nn.Module]:
        """The modules that run the draft's forwards (the engine installs its kernels on them)."""
        return []

    def compile(self) -> None:
        """Run the draft's forwards compiled from now on, where the draft has a compiled path (the engine
        calls this when it compiles the target's step); by default they stay eager."""

    def build_weights(self, config: dict, tensors: dict[str, torch.Tensor]):
        """An adapter version's weights, ready to decode with (AdapterError if they do not fit)."""
        from adaptive_spec.formats.adapters import AdapterError

        raise AdapterError(f"adapters need a model draft (early-exit:N, head or a separate model), not {self.name}")

    def new_vocab(self, weights=None):
        """A fresh view of the draft's LM head for an adapter version (drafters/vocab.py); `weights` are the version's
        (build_weights), for a draft whose versions bring an LM head of their own (an EAGLE-3 head)."""
        from adaptive_spec.formats.adapters import AdapterError

        raise AdapterError(f"{self.name} has no vocabulary to restrict")
