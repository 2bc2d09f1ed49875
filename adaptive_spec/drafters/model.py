"""A draft that is a causal LM: a separate small model, or an early exit of the target."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

import torch

from adaptive_spec.cache import feeding, kv
from adaptive_spec.drafters import Drafter, DraftRow, Proposal, by_adapter
from adaptive_spec.drafters.vocab import DraftVocab

CATCH_UP_ALONE = 8  # a row with more unseen context than this catches up in a forward of its own


class ModelDrafter(Drafter):
    """Drafts k tokens per row autoregressively: one forward per draft step for all the rows that
    draft with the same adapter (the base layers, or an adapter's merged copy of them).

    Each row's draft cache trails its context: a `propose` first feeds every context token the
    cache has not seen (after a rollback, or after steps where the engine drafted nothing), then
    one token per further draft step. Example: a row's context has 40 tokens and its cache 37;
    with k=3 the first forward feeds it 3 tokens and yields d1, the next two feed d1 and d2 and
    yield d2 and d3. d3 is never fed; if it is accepted, the next `propose` feeds it along with
    the new token. Rows feeding fewer tokens are padded in the same forward. A row with more
    than CATCH_UP_ALONE unseen tokens (its prompt, the first time it drafts) first feeds all but
    its last one alone, so that one long row does not pad every other row to its length.
    """

    takes_adapters = True

    def __init__(self, model, name: str = "model"):
        self.model = model
        self.name = name
        self.device = next(model.parameters()).device
        self.base_layers = model.model.layers if hasattr(model, "model") else None  # what adapters merge onto
        self.vocab = self.new_vocab()  # the base draft's view of the LM head

    def new_cache(self) -> kv.BatchCache:
        return kv.BatchCache.for_model(self.model)

    def new_vocab(self, weights=None) -> DraftVocab:
        return DraftVocab(self.model.get_output_embeddings())

    def models(self) -> list[torch.nn.Module]:
        return [self.model]

    def build_weights(self, config: dict, tensors: dict[str, torch.Tensor]) -> torch.nn.ModuleList:
        """An adapter's weights, ready to decode with: a copy of the base layers with its LoRA
        merged in (`lora.merge_into_slot`). Raises AdapterError if it does not fit."""
        from adaptive_spec.formats import adapters, lora

        if self.base_layers is None:
            raise adapters.AdapterError("this draft model has no decoder layers at model.layers to adapt")
        pairs = lora.lora_pairs(config, tensors)
        lora.check(self.model, pairs)
        return lora.merge_into_slot(self.base_layers, pairs)

    @contextmanager
    def using(self, adapter):
        """Decode with an adapter's layers for the block (the base layers for None); yields the
        adapter's view of the LM head. `self.model` holds the base layers outside such a block."""
        if adapter is None:
            yield self.vocab
            return
        self.model.model.layers = adapter.weights
        try:
            yield adapter.vocab
        finally:
            self.model.model.layers = self.base_layers

    @torch.inference_mode()
    def propose(
        self,
        cache: kv.BatchCache,
        rows: Sequence[DraftRow],
        ks: list[int],
        free: list[list[int]] | None = None,
        depths: list[int] | None = None,
    ) -> list[Proposal]:
        ks = list(ks)  # a row whose constraints leave it nothing to propose stops early
        drafting = [i for i, k in enumerate(ks) if k > 0]
        feeds = {i: rows[i].ids[cache.lengths[rows[i].slot] :] for i in drafting}
        fed = {i: len(feeds[i]) for i in drafting}
        tokens: dict[int, list[int]] = {i: [] for i in drafting}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in drafting}
        for adapter, group in by_adapter(rows, drafting):
            with self.using(adapter) as vocab:
                for i in group:
                    if len(feeds[i]) > CATCH_UP_ALONE:
                        feeding.feed(self.model, cache, [rows[i].slot], [feeds[i][:-1]], decoder_only=True)
                        feeds[i] = feeds[i][-1:]
                while live := [i for i in group if len(tokens[i]) < ks[i]]:
                    logits = self._next_logits(vocab, cache, [rows[i].slot for i in live], [feeds[i] for i in live])
                    choices = vocab.choose_rows(logits, [rows[i] for i in live], [tokens[i] for i in live])
                    for i, (token, row_probs) in zip(live, choices, strict=True):  # logits: [n, n_vocab]
                        if token is None:  # its constraints allow none of its tokens, or its logits are NaN
                            ks[i] = len(tokens[i])
                            continue
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

    def _next_logits(self, vocab: DraftVocab, cache: kv.BatchCache, slots: list[int], feeds: list[list[int]]):
        """Logits after each row's feed: [n, vocab], or [n, n_vocab] over a restricted vocabulary."""
        if not vocab.restricted:
            return feeding.feed(self.model, cache, slots, feeds)
        return vocab.logits(feeding.feed(self.model, cache, slots, feeds, decoder_only=True))
