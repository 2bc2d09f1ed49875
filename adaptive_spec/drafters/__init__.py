"""Drafters propose the next tokens; the target verifies them.

A drafter has three verbs (cf. transformers `candidate_generator.py`):

- `reset(context)` before a request, with its prompt (a model draft prefills its cache);
- `propose(context, k, params, generator)` returns up to k tokens after `context`;
- `rollback(valid_len)` after verification: only `context[:valid_len]` of the new context is
  known to be right, so any state past it must go.

Draft specs, as `Engine.from_pretrained(draft=...)` takes them:

- `early-exit:N`: the target's first N layers, final norm and LM head (see `early_exit.py`);
- `ngram` (or `ngram:N` for the longest n-gram tried): prompt lookup, no model;
- anything else: a separate model with the target's vocabulary, loaded by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from adaptive_spec.sampling import SamplingParams


@dataclass
class Proposal:
    tokens: torch.Tensor  # [n] int64, n <= k
    probs: torch.Tensor | None  # [n, vocab] the distribution each token was drawn from; None = deterministic
    forwards: int = 0  # draft model forward passes spent
    fed: int = 0  # tokens the first forward fed: 1, or more to catch up on context the draft had not seen


class Drafter(Protocol):
    name: str

    def reset(self, context: list[int]) -> None: ...

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal: ...

    def rollback(self, valid_len: int) -> None: ...
