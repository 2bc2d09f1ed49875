"""A draft that is a causal LM: a separate small model, or an early exit of the target."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from adaptive_spec import cpu_linear, kv
from adaptive_spec.drafters import DraftRow, Proposal
from adaptive_spec.sampling import logits_to_probs, sample

CATCH_UP_ALONE = 8  # a row with more unseen context than this catches up in a forward of its own


class ModelDrafter:
    """Drafts k tokens per row autoregressively, all rows in one forward per draft step.

    Each row's draft cache trails its context: a `propose` first feeds every context token the
    cache has not seen (after a rollback, or after steps where the engine drafted nothing), then
    one token per further draft step. Example: a row's context has 40 tokens and its cache 37;
    with k=3 the first forward feeds it 3 tokens and yields d1, the next two feed d1 and d2 and
    yield d2 and d3. d3 is never fed; if it is accepted, the next `propose` feeds it along with
    the new token. Rows feeding fewer tokens are padded in the same forward. A row with more
    than CATCH_UP_ALONE unseen tokens (its prompt, the first time it drafts) first feeds all but
    its last one alone, so that one long row does not pad every other row to its length.
    """

    def __init__(self, model, name: str = "model"):
        self.model = model
        self.name = name
        self.device = next(model.parameters()).device
        self.vocab: torch.Tensor | None = None  # [n_vocab] token ids the draft may propose; None = all
        self._head_rows: torch.Tensor | None = None  # [n_vocab, hidden] the LM head's rows for them
        self._full_vocab = model.get_output_embeddings().weight.shape[0]

    def new_cache(self) -> kv.BatchCache:
        return kv.BatchCache.for_model(self.model)

    def restrict_vocab(self, token_ids) -> None:
        """Propose only these tokens (None: any), computing just their rows of the LM head.

        The default model's head has 49152 rows, about a third of an `early-exit:4` step. Traffic
        of one kind uses far fewer tokens: restricted to the 1,200 a domain's records used, the head
        costs 1/40 of that. It stays lossless: the target still verifies every token, and a token
        outside the set is simply never proposed (under sampling, the draft's distribution is the
        restricted one, which rejection sampling corrects like any other).
        """
        if token_ids is None:
            self.vocab = self._head_rows = None
            return
        vocab = torch.as_tensor(sorted(set(int(t) for t in token_ids)), dtype=torch.long, device=self.device)
        if vocab.numel() == 0 or int(vocab[0]) < 0 or int(vocab[-1]) >= self._full_vocab:
            raise ValueError(f"a draft vocabulary must be non-empty ids in [0, {self._full_vocab})")
        head = self.model.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise ValueError("restricting the vocabulary needs an LM head without bias")
        self._head_rows = head.weight[vocab].contiguous()
        # the same rule as the layers' linears (cpu_linear.install)
        self._head_product = cpu_linear.skinny_linear if cpu_linear.applies(self._head_rows) else F.linear
        self.vocab = vocab

    def swap_layers(self, layers) -> torch.nn.ModuleList:
        """Decode with these decoder layers from now on (an adapter's slot); returns the old ones.
        The caller clears every draft cache: its keys and values came from the old layers."""
        old = self.model.model.layers
        self.model.model.layers = layers
        return old

    @torch.inference_mode()
    def propose(self, cache: kv.BatchCache, rows: list[DraftRow], ks: list[int]) -> list[Proposal]:
        drafting = [i for i, k in enumerate(ks) if k > 0]
        feeds = {i: rows[i].ids[cache.lengths[rows[i].slot] :] for i in drafting}
        fed = {i: len(feeds[i]) for i in drafting}
        for i in drafting:
            if len(feeds[i]) > CATCH_UP_ALONE:
                kv.feed(self.model, cache, [rows[i].slot], [feeds[i][:-1]], decoder_only=True)
                feeds[i] = feeds[i][-1:]
        tokens: dict[int, list[int]] = {i: [] for i in drafting}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in drafting}
        while live := [i for i in drafting if len(tokens[i]) < ks[i]]:
            logits = self._next_logits(cache, [rows[i].slot for i in live], [feeds[i] for i in live])  # [n, n_vocab]
            for j, i in enumerate(live):
                row = rows[i]
                if row.params.greedy:
                    choice = int(logits[j].argmax())
                else:
                    row_probs = logits_to_probs(logits[j : j + 1], row.params)  # [1, n_vocab]
                    choice = int(sample(row_probs, row.generator)[0])
                    probs[i].append(self._to_full_vocab(row_probs[0]))
                token = choice if self.vocab is None else int(self.vocab[choice])
                tokens[i].append(token)
                feeds[i] = [token]
        return [
            Proposal(
                torch.tensor(tokens.get(i, []), dtype=torch.long, device=self.device),
                torch.stack(probs[i]) if probs.get(i) else None,  # [k, vocab]
                forwards=len(tokens.get(i, [])),
                fed=fed.get(i, 0),
            )
            for i in range(len(rows))
        ]

    def _next_logits(self, cache: kv.BatchCache, slots: list[int], feeds: list[list[int]]) -> torch.Tensor:
        """Logits after each row's feed: [n, vocab], or [n, n_vocab] over the restricted vocabulary."""
        if self.vocab is None:
            return kv.feed(self.model, cache, slots, feeds)
        hidden = kv.feed(self.model, cache, slots, feeds, decoder_only=True)  # [n, hidden]
        return self._head_product(hidden, self._head_rows)  # [n, n_vocab]

    def _to_full_vocab(self, probs: torch.Tensor) -> torch.Tensor:
        if self.vocab is None:
            return probs
        return torch.zeros(self._full_vocab, dtype=probs.dtype, device=probs.device).index_copy_(0, self.vocab, probs)
