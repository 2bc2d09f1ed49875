"""A draft that is a causal LM: a separate small model, or an early exit of the target."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from adaptive_spec import cpu_linear, kv
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
        self.vocab: torch.Tensor | None = None  # [n_vocab] token ids the draft may propose; None = all
        self._head_rows: torch.Tensor | None = None  # [n_vocab, hidden] the LM head's rows for them
        self._full_vocab = model.get_output_embeddings().weight.shape[0]

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

    def reset(self, context: list[int]) -> None:
        """Start a request with an empty cache: the first `propose` feeds the prompt as catch-up.

        Lazy on purpose: a first step that drafts nothing (dynamic k always starts so) streams its
        token as soon as the target alone would, without waiting for the draft's prefill.
        """
        self.cache = kv.new_cache(self.model)

    @torch.inference_mode()
    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        feed = context[kv.cache_len(self.cache) :]
        fed = len(feed)
        tokens, rows = [], []
        for _ in range(k):
            logits = self._next_logits(feed)  # [1, n_vocab]
            if params.greedy:
                choice = int(logits[-1].argmax())
            else:
                probs = logits_to_probs(logits, params)  # [1, n_vocab]
                choice = int(sample(probs, generator)[0])
                rows.append(self._to_full_vocab(probs[0]))
            token = choice if self.vocab is None else int(self.vocab[choice])
            tokens.append(token)
            feed = [token]
        probs = torch.stack(rows) if rows else None  # [k, vocab]
        return Proposal(torch.tensor(tokens, dtype=torch.long, device=self.device), probs, forwards=k, fed=fed)

    def _next_logits(self, feed: list[int]) -> torch.Tensor:
        """Logits after `feed` ([1, vocab], or [1, n_vocab] over the restricted vocabulary)."""
        inputs = torch.tensor([feed], device=self.device)
        if self.vocab is None:
            return self.model(input_ids=inputs, past_key_values=self.cache, use_cache=True, logits_to_keep=1).logits[0]
        hidden = self.model.model(input_ids=inputs, past_key_values=self.cache, use_cache=True).last_hidden_state
        return self._head_product(hidden[0, -1:], self._head_rows)  # [1, n_vocab]

    def _to_full_vocab(self, probs: torch.Tensor) -> torch.Tensor:
        if self.vocab is None:
            return probs
        return torch.zeros(self._full_vocab, dtype=probs.dtype, device=probs.device).index_copy_(0, self.vocab, probs)

    def invalidate(self) -> None:
        """Forget the cache (its keys and values came from other weights); the next step re-feeds."""
        self.cache = kv.new_cache(self.model)

    def rollback(self, valid_len: int) -> None:
        kv.rollback(self.cache, valid_len)
