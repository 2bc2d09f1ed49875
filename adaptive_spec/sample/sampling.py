"""Turning logits into the distribution a request samples from.

Temperature, top-k and top-p are applied the same way to the target's and the draft's logits,
so that with a good draft the two processed distributions agree. Losslessness does not depend on
the draft being processed the same way: rejection sampling only needs the draft tokens to be
drawn from the `draft_probs` it is given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A 64-bit signed seed, as OpenAI's; choice i of n draws from seed + i, which torch's generator still takes.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks for. `temperature == 0` means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if not (0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and not (isinstance(self.seed, int) and SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}")


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed next-token distribution for each row.

    logits: [n, vocab]  ->  probs: [n, vocab] in float32, rows summing to 1.

    Example: logits [2.0, 1.0, 0.0, -1.0] at temperature 1 give probs about
    [0.64, 0.24, 0.09, 0.03]. With top_k=2 that becomes [0.73, 0.27, 0, 0]; with top_p=0.7 the
    smallest set whose mass reaches 0.7 is {0, 1} (0.64 < 0.7 <= 0.88), giving the same result.
    Greedy requests never come here: they compare argmaxes.
    """
    logits = logits.float() / max(params.temperature, 1e-5)
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [n, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Mass strictly before each token; a token stays while that mass is below top_p, so the
        # most likely token always stays.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        dropped = mass_before >= params.top_p  # [n, vocab]
        dropped[..., 0] = False  # also when top_p rounds to 0 in float32 (e.g. 1e-300): never an empty set
        sorted_logits = sorted_logits.masked_fill(dropped, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits.softmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row. probs: [n, vocab] -> [n] (int64)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
