"""What the dynamic-k policy (dynamic_k.py) measures and predicts from: the cost of a forward by the tokens
it feeds, the cost of a step's draft forwards as a line, and acceptance counted with fading memory, overall
and by draft position; and the tokens a step yields from them.

    costs = StepCosts(); costs.observe(tokens=5, seconds=0.024); costs.estimate(9)   # a verify of 9 tokens
    expected_tokens([0.7, 0.02], k=2)                                                # 1.714 tokens a forward

Each is a small record with `observe` and an estimate, kept per engine (costs belong to the hardware and
the model pair) or per (domain, adapter version) key (acceptance belongs to the text and the adapter).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def expected_tokens(alpha: float | Sequence[float], k: int) -> float:
    """Tokens emitted per target forward when drafting k, each accepted with probability alpha.

    `alpha` may be a profile instead: per draft position j (0-based), the chance that token j is
    accepted given that all before it were (positions past its end repeat its last value). Then
    tokens = 1 + a0 + a0 a1 + ... + a0 ... a(k-1). Example: a head whose first token is accepted
    0.7 of the time and whose second almost never, [0.7, 0.02], gives 1.7 tokens at k = 1 and
    1.714 at k = 2, not the 2.19 a single alpha of 0.7 promises.
    """
    if not isinstance(alpha, Sequence):
        if alpha >= 1.0:
            return k + 1.0
        return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    tokens, run = 1.0, 1.0
    for j in range(k):
        run *= alpha[min(j, len(alpha) - 1)]
        tokens += run
    return tokens


def ema(old: float | None, new: float, weight: float) -> float:
    """A moving average: `new` weighted by `weight` over `old` (None: no average yet, so `new`)."""
    return new if old is None else (1 - weight) * old + weight * new


@dataclass
class StepCosts:
    """Seconds of one forward by the number of tokens it feeds (rows x tokens per row).

    Where a size was measured, its moving average; between two measured sizes, the straight
    line between them; outside, the nearest measurement scaled by the prior shape
    `1 + slope * (tokens - 1)` (a forward's cost is roughly affine in its tokens). Above the largest
    size measured, the line through the two largest when it is cheaper than the prior (never
    falling): a size estimated too dear is never chosen, so never measured, and the estimate is never
    corrected, where one estimated too cheap is chosen once and measured. A bench-drift run of the
    trained python head (AMD EPYC, bf16) measured verifies of 1-3 tokens only while its traffic was
    accepted 0.3-0.4 of the time; afterwards its profile (0.76, 0.64) wanted k = 3, but the prior put
    a verify of 4 tokens at 1.14 verifies of 3 where 1.02 was likely, and every step drafted 2
    (2.02x the target alone, 2.31 tokens a forward). Never more than
    a larger size measured: feeding fewer tokens does not cost more. Without that bound one slow
    plain step (a stall, a page fault) made plain decoding look dearer than drafting; the policy
    then drafted on every step, never timed a plain step again, and kept the outlier for good
    (2 rows: plain 123 ms "measured" once, a 4-token verify 90 ms, so k = 1 on every step of an
    untrained draft, 0.74x the target alone).
    """

    slope: float = 0.2  # prior: each extra token fed costs this fraction of a one-token forward
    decay: float = 0.1
    seconds: dict[int, float] = field(default_factory=dict)

    def observe(self, tokens: int, seconds: float) -> None:
        self.seconds[tokens] = ema(self.seconds.get(tokens), seconds, self.decay)

    def prior(self, tokens: int) -> float:
        return 1.0 + self.slope * (tokens - 1)

    def estimate(self, tokens: int) -> float | None:
        above = [t for t in self.seconds if t > tokens]
        bound = min((self.seconds[t] for t in above), default=float("inf"))
        if tokens in self.seconds:
            return min(self.seconds[tokens], bound)
        below = [t for t in self.seconds if t < tokens]
        if below and above:
            lo, hi = max(below), min(above)
            line = self.seconds[lo] + (self.seconds[hi] - self.seconds[lo]) * (tokens - lo) / (hi - lo)
            return min(line, bound)
        if not below and not above:
            return None
        near = max(below) if below else min(above)
        scaled = self.seconds[near] * self.prior(tokens) / self.prior(near)
        if len(below) >= 2:  # above every size measured: the line through the two largest, if cheaper
            lo = max(t for t in below if t != near)
            rise = max(0.0, (self.seconds[near] - self.seconds[lo]) / (near - lo))
            scaled = min(scaled, self.seconds[near] + rise * (tokens - near))
        return min(scaled, bound)


@dataclass
class DraftingCosts:
    """Seconds of a step's draft forwards, by the rows that draft, as a line: a part the step pays once
    and a part per forward, `seconds = first + per_forward * forwards`, fitted over recent steps (least
    squares with fading memory, `decay` per step). A step's first draft forward costs more than the
    others: it feeds the tokens the last verify accepted (up to k + 1 of them), it reads the draft's
    weights again after the target's forward has pushed them out of the cache, and the step's own
    Python runs once. Measured on the default model's head (AMD EPYC, bf16, one row, fixed k of 0-7
    taking turns over 48 python requests): a step of 1 / 2 / 3 / 4 / 5 / 6 / 7 draft forwards took
    1.42 / 1.84 / 2.28 / 2.75 / 3.29 / 3.58 / 4.12 ms, about 0.97 + 0.45 per forward. A mean per forward
    (StepCosts over `seconds / forwards`, 0.88-0.98 ms in the runs where dynamic k drafted 3-4) charges a
    fourth draft token twice what it costs, and kept chains a token shorter than they paid.

    No line while the steps' forwards have hardly varied (their variance under `min_spread`, e.g.
    every step drafting 3): there is nothing to tell the two parts apart, and `DynamicK.drafting_s`
    uses the mean per forward. A stall does not bend it for long: a step is taken at no more than
    `max_ratio` times what the line predicted for it, and a further forward never costs less than
    `min_share` of the mean forward (a line fitted flat would make deep drafts look free).
    """

    decay: float = 0.02
    min_spread: float = 0.1
    max_ratio: float = 3.0
    min_share: float = 0.25
    # rows -> the fading sums of [1, forwards, forwards^2, seconds, forwards * seconds] over its steps
    sums: dict[int, list[float]] = field(default_factory=dict)

    def observe(self, rows: int, forwards: int, seconds: float) -> None:
        line = self.line(rows)
        if line is not None:
            seconds = min(seconds, self.max_ratio * (line[0] + line[1] * forwards))
        sums = self.sums.setdefault(rows, [0.0] * 5)
        keep = 1.0 - self.decay
        for i, value in enumerate((1.0, forwards, forwards * forwards, seconds, forwards * seconds)):
            sums[i] = keep * sums[i] + value

    def line(self, rows: int) -> tuple[float, float] | None:
        """(first, per_forward) seconds for `rows` rows, or None: too few steps, or too little spread."""
        sums = self.sums.get(rows)
        if sums is None or sums[0] < 4.0:
            return None
        weight, forwards, squares, seconds, products = sums
        mean_f, mean_s = forwards / weight, seconds / weight
        spread = squares / weight - mean_f * mean_f
        if spread < self.min_spread:
            return None
        per_forward = (products / weight - mean_f * mean_s) / spread
        per_forward = min(max(per_forward, self.min_share * mean_s / mean_f), mean_s / mean_f)
        return mean_s - per_forward * mean_f, per_forward


@dataclass
class Acceptance:
    """Drafted tokens accepted, counted with fading memory, from a starting figure.

    estimate = (accepted + prior * m) / (drafted + m), where m pseudo-tokens stand for the prior:
    the mean of a Beta posterior whose old evidence decays by `keep` per new token.

    The same counts by draft position (`reached`, `kept`: how often position j was verified with
    every token before it accepted, and how often it was accepted then) give the profile: how
    acceptance falls from the first draft token to the later ones (`profile`).
    """

    prior: float
    accepted: float = 0.0
    drafted: float = 0.0
    reached: list[float] = field(default_factory=list)
    kept: list[float] = field(default_factory=list)

    def observe(self, accepted: int, drafted: int, keep: float, k: int = 0) -> None:
        """`accepted` of `drafted` trials (accepted tokens plus the rejected one); `k`: the tokens the
        step drafted, for the profile (0: not by position)."""
        self.accepted = keep * self.accepted + accepted
        self.drafted = keep * self.drafted + drafted
        if not k:
            return
        if len(self.reached) < k:
            self.reached += [0.0] * (k - len(self.reached))
            self.kept += [0.0] * (k - len(self.kept))
        self.reached = [keep * value for value in self.reached]
        self.kept = [keep * value for value in self.kept]
        for j in range(min(accepted + 1, k)):  # positions verified with all before them accepted
            self.reached[j] += 1
            self.kept[j] += j < accepted

    def estimate(self, prior_trials: float) -> float:
        return (self.accepted + self.prior * prior_trials) / (self.drafted + prior_trials)

    def profile(self, prior_trials: float) -> list[float]:
        """Per draft position, the chance it is accepted given all before it were, each from the
        overall estimate counted as `prior_trials` tokens: a position seldom reached stays near it."""
        overall = self.estimate(prior_trials)
        return [
            (kept + overall * prior_trials) / (reached + prior_trials)
            for reached, kept in zip(self.reached, self.kept, strict=True)
        ]
