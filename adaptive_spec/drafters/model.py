"""A draft that is a causal LM: a separate small model, or an early exit of the target."""

from __future__ import annotations

import torch

from adaptive_spec import kv
from adaptive_spec.drafters import Proposal
from adaptive_spec.sampling import SamplingParams, logits_to_probs, sample


class ModelDrafter:
    """Drafts k tokens autoregressively with its own KV cache.

    The cache trails the context: each `propose` first feeds every context token the cache has
    not seen (after a rollback, or after steps where the engine drafted nothing), then one token
    per further draft step. Example: the context has 40 tokens and the cache 37; with k=3 the
    first forward feeds 3 tokens and yields d1, the next two feed d1 and d2 and yield d2 and d3.
    d3 is never fed; if it is accepted, the next `propose` feeds it along with the new token.
    """

    def __init__(self, model, name: str = "model"):
        self.model = model
        self.name = name
        self.cache = None
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def reset(self, context: list[int]) -> None:
        """Prefill the prompt (all but its last token, which the first step feeds)."""
        self.cache = kv.new_cache(self.model)
        if len(context) > 1:
            self.model(input_ids=torch.tensor([context[:-1]], device=self.device), past_key_values=self.cache,
                       use_cache=True, logits_to_keep=1)

    @torch.inference_mode()
    def propose(self, context: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        feed = context[kv.cache_len(self.cache):]
        tokens, rows = [], []
        for _ in range(k):
            logits = self.model(input_ids=torch.tensor([feed], device=self.device), past_key_values=self.cache,
                                use_cache=True, logits_to_keep=1).logits[0]  # [1, vocab]
            if params.greedy:
                token = int(logits[-1].argmax())
            else:
                probs = logits_to_probs(logits, params)  # [1, vocab]
                token = int(sample(probs, generator)[0])
                rows.append(probs[0])
            tokens.append(token)
            feed = [token]
        probs = torch.stack(rows) if rows else None  # [k, vocab]
        return Proposal(torch.tensor(tokens, dtype=torch.long, device=self.device), probs, forwards=k)

    def invalidate(self) -> None:
        """Forget the cache (its keys and values came from other weights); the next step re-feeds."""
        self.cache = kv.new_cache(self.model)

    def rollback(self, valid_len: int) -> None:
        kv.rollback(self.cache, valid_len)
