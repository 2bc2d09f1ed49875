"""A draft that is a causal LM: a separate small model, or an early exit of the target."""

from __future__ import annotations

import torch

from adaptive_spec import kv
from adaptive_spec.drafters import DraftRow, Proposal
from adaptive_spec.drafters.vocab import DraftVocab

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
        self.vocab = DraftVocab(model.get_output_embeddings())

    def new_cache(self) -> kv.BatchCache:
        return kv.BatchCache.for_model(self.model)

    def restrict_vocab(self, token_ids) -> None:
        """Propose only these tokens (None: any); see `DraftVocab.restrict`."""
        self.vocab.restrict(token_ids)

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
                token, row_probs = self.vocab.choose(logits[j], rows[i])
                tokens[i].append(token)
                if row_probs is not None:
                    probs[i].append(row_probs)
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
        if not self.vocab.restricted:
            return kv.feed(self.model, cache, slots, feeds)
        return self.vocab.logits(kv.feed(self.model, cache, slots, feeds, decoder_only=True))  # [n, n_vocab]
