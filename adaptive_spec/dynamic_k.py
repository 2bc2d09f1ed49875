"""Choosing how many tokens to draft at each step.

Drafting k tokens that are each accepted with probability `alpha` (independently, the usual
model) yields, per target forward,

    tokens(k) = (1 - alpha ** (k + 1)) / (1 - alpha)          (accepted + recovered/bonus)

and costs, in units of one plain target step (one target forward on one token),

    cost(k) = k * draft_cost + verify_cost(k)

where `draft_cost` is one draft forward and `verify_cost(k)` one target forward on k + 1 tokens,
both relative to a plain target step. Plain decoding is k = 0: one token for a cost of 1. The
policy picks the k in 0..k_max with the most tokens per unit of cost.

Worked example (the default model on this CPU: a draft step 0.3 of a target step, verifying
costs about 1 + 0.1 k):

- alpha = 0.8: k=2 gives 2.44 / 1.8 = 1.36, k=3 gives 2.95 / 2.2 = 1.34, so k = 2, a 1.36x
  speedup over plain decoding;
- alpha = 0.5: k=1 gives 1.5 / 1.4 = 1.07, k=2 gives 1.75 / 1.8 = 0.97, so k = 1;
- alpha = 0.06 (an untrained early exit): k=1 gives 1.06 / 1.4 = 0.76 < 1, so k = 0: the
  engine decodes plainly and loses nothing. Every `probe_every` plain steps it drafts one
  token to keep measuring alpha, so a draft that gets better is noticed.

Costs are measured, not assumed: the engine reports the wall time of every draft and verify
forward and the policy keeps moving averages, per k for verification. They belong to the
hardware and the model pair, so they persist across requests. Acceptance belongs to the text:
each request starts from the engine-wide estimate and then follows its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens emitted per target forward when drafting k, each accepted with probability alpha."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def _ema(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1 - weight) * old + weight * new


@dataclass
class DynamicK:
    k_max: int = 8
    probe_every: int = 16  # plain steps between one-token probes while drafting does not pay
    prior_draft_cost: float = 0.3  # relative to a plain target step, until measured
    prior_verify_slope: float = 0.1  # extra cost per verified token, until measured
    decay: float = 0.1  # weight of the newest observation in the moving averages

    draft_s: float | None = None  # one draft forward, seconds
    verify_s: dict[int, float] = field(default_factory=dict)  # k -> one verify forward on k+1 tokens, seconds
    engine_alpha: float = 0.5  # across requests
    alpha: float = 0.5  # this request
    _plain_steps: int = 0

    def start_request(self) -> None:
        self.alpha = self.engine_alpha
        self._plain_steps = 0

    def draft_cost(self) -> float:
        plain = self.verify_s.get(0)
        if self.draft_s is None or plain is None:
            return self.prior_draft_cost
        return self.draft_s / plain

    def verify_cost(self, k: int) -> float:
        """Measured where k was seen; elsewhere the nearest measurement, extended by a slope."""
        plain = self.verify_s.get(0)
        if plain is None or k not in self.verify_s:
            seen = [j for j in self.verify_s if j > 0]
            slope = self.prior_verify_slope
            if plain is not None and seen:
                slope = sum((self.verify_s[j] / plain - 1.0) / j for j in seen) / len(seen)
                slope = max(slope, 0.0)
            return 1.0 + slope * k
        return self.verify_s[k] / plain

    def choose(self, limit: int) -> int:
        """The k for the next step, at most `limit` (what remains of the budget)."""
        limit = min(limit, self.k_max)
        if limit <= 0:
            return 0
        draft_cost = self.draft_cost()
        best_k, best = 0, 1.0
        for k in range(1, limit + 1):
            gain = expected_tokens(self.alpha, k) / (k * draft_cost + self.verify_cost(k))
            if gain > best:
                best_k, best = k, gain
        if best_k == 0:
            self._plain_steps += 1
            if self._plain_steps >= self.probe_every:
                self._plain_steps = 0
                return 1
        return best_k

    def observe(
        self, k: int, num_accepted: int, draft_s: float, draft_forwards: int, verify_s: float, catch_up: bool = False
    ) -> None:
        """Fold in one step: k drafted, num_accepted kept, and the time each model took.

        `catch_up` marks a step whose first draft forward also fed context the draft had not
        seen (after plain steps: up to `probe_every` tokens). Its time is not a draft step's
        cost, so it is left out; counting it once made a trained draft look 3x dearer than it
        is and kept the engine decoding plainly.
        """
        self.verify_s[k] = _ema(self.verify_s.get(k), verify_s, self.decay)
        if draft_forwards and not catch_up:
            self.draft_s = _ema(self.draft_s, draft_s / draft_forwards, self.decay)
        if k:
            # The step is evidence on num_accepted successes and, if one was rejected, a failure.
            # Weighted so that a draft which got better is noticed within a few probes: from
            # alpha 0.05, two accepted one-token probes give 0.34, then 0.54, and k = 1 pays.
            trials = num_accepted + (num_accepted < k)
            observed = num_accepted / trials
            self.alpha = _ema(self.alpha, observed, min(0.5, 0.3 * trials))
            self.engine_alpha = _ema(self.engine_alpha, observed, min(1.0, 0.25 * trials) * self.decay)

    def new_draft(self, expected_alpha: float | None) -> None:
        """The draft changed (an adapter swap): re-measure its cost, and start from what the
        trainer measured on held-out traffic for it (its greedy match), when known."""
        self.draft_s = None
        if expected_alpha is not None:
            self.engine_alpha = self.alpha = float(expected_alpha)
