"""The gate's statistical decision: promote a candidate only when it beats the champion with 95% confidence.

    scores = RecordScores(matched=[40, 12, 55], expected=[30.1, 9.4, 41.0], positions=[64, 32, 80])
    decision = decide(candidate_scores, champion_scores)      # the same held-out records, scored by each draft
    decision.promote, decision.confidence, decision.reason
    gate = StatisticalGate()                                   # what OnlineTrainer calls: decide(candidate, champion)

Run its tests: `.venv/bin/python -m pytest tests/trainer/test_decision.py -q` (no model, a few seconds).

A fixed floor on held-out positions (trainer/evaluation/gate.py's `Gate`) waits as long for a candidate that
matches the target 0.30 of the time against a champion at 0.05 as for one at 0.06: the first
needs a few hundred positions to be recognised, the second thousands. The decision here is a
one-sided test over held-out *records* instead, so a large gain is promoted early and a small one
waits for evidence. It is the online trainer's default gate (trainer/loop/online.py `OnlineSettings`).

Both drafts are scored on the same records (paired). Per record i: n_i scored positions, c_i and
h_i the positions where the candidate's and the champion's argmax is the target's top-1 (the
greedy acceptance, trainer/evaluation/gate.py). The gain is the ratio estimator

    gain = sum(c_i - h_i) / sum(n_i)

Positions of one record are not independent (a draft that gets one line of code right gets the
next ones right too), so the record is the unit of evidence: the standard error is the
cluster-robust one of a ratio estimator, from the residuals e_i = (c_i - h_i) - gain * n_i,

    se = sqrt(R / (R - 1) * sum(e_i^2)) / sum(n_i)          (R records)

and the confidence that the candidate gains more than `margin` is the Student-t probability
T_{R-1}((gain - margin) / se): the t distribution, not the normal one, because early decisions
rest on a handful of records. Promote when it is at least `confidence` (0.99), the expected
acceptance under sampling did not fall, and the floors (`min_records`, `min_positions`) hold.

Worked example: 9 held-out records, 320 positions; the champion (the base draft) matches 30, the
candidate 68: gain 38 / 320 = +0.119. If the per-record residuals give se = 0.031, then
t = (0.119 - 0.02) / 0.031 = 3.2 on 8 degrees of freedom: 99.4% confidence, promoted. A candidate
at +0.04 with the same spread gives t = 0.65: 73%, it waits for more records.

Testing gain > margin rather than gain > 0 is what keeps a candidate that is only equal to the
champion out: at a true gain of 0 it must overshoot the margin by 2.4 standard errors or more,
which gets rarer as evidence accumulates instead of staying at 1% per look (the trainer looks
after every round). The defaults come from simulated sequential looks (records of 16-96
positions, a look every 2 records up to 40, 400 seeds each; tests/trainer/test_decision.py keeps
the same check): at confidence 0.95 and margin 0.01 an equal candidate was promoted in 19 of 400
runs, at 0.99 and 0.01 in 5, at 0.99 and 0.02 (the defaults) in none, nor a worse one (-0.03),
while a gain of +0.2 was promoted in every run after 264 positions (median) and +0.1 after 433.
A lineage's first round also looks at every held-out record that arrives while it trains
(trainer/loop/online.py `_FirstLook`). With a look at every record from 4 to 40, over 1,000 seeds, the
defaults promoted an equal candidate in 3 runs (0.3%), a worse one (-0.02, -0.05) in none, and a
gain of +0.2 after 245 positions (median); the tests look at every record.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from trainer.settings import TrainerSettings


@dataclass(frozen=True)
class RecordScores:
    """One draft's agreement with the target on each held-out record (records with no position left out)."""

    matched: np.ndarray  # [records] int: positions whose draft argmax is the target's top-1
    expected: np.ndarray  # [records] float: sum over positions of sum_i min(q(i), p_t(i)) over the top-m
    positions: np.ndarray  # [records] int: positions scored

    def __post_init__(self) -> None:
        for name in ("matched", "expected", "positions"):
            object.__setattr__(self, name, np.asarray(getattr(self, name)))
        if not self.matched.shape == self.expected.shape == self.positions.shape:
            raise ValueError("matched, expected and positions need one entry per record")

    @property
    def records(self) -> int:
        return len(self.positions)

    @property
    def total_positions(self) -> int:
        return int(self.positions.sum())

    @property
    def greedy_match(self) -> float:
        return float(self.matched.sum() / self.positions.sum()) if self.total_positions else math.nan

    @property
    def expected_acceptance(self) -> float:
        return float(self.expected.sum() / self.positions.sum()) if self.total_positions else math.nan


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str
    candidate: float = math.nan  # greedy match over the held-out positions
    champion: float = math.nan
    gain: float = math.nan
    standard_error: float = math.nan
    confidence: float = 0.0  # that the candidate's true gain exceeds the margin
    records: int = 0
    positions: int = 0


def paired_gain(candidate: RecordScores, champion: RecordScores) -> tuple[float, float]:
    """(gain in greedy match, its cluster-robust standard error) over the same records; se is NaN with one record."""
    differences = (candidate.matched - champion.matched).astype(float)  # [records]
    total = float(candidate.positions.sum())
    gain = float(differences.sum()) / total
    records = candidate.records
    if records < 2:
        return gain, math.nan
    residuals = differences - gain * candidate.positions  # [records]
    return gain, math.sqrt(records / (records - 1) * float(np.sum(residuals**2))) / total


@dataclass(frozen=True)
class Thresholds:
    confidence: float = TrainerSettings.gate_confidence  # promote at this confidence that the gain exceeds the margin
    margin: float = 0.02  # in greedy match: the gain that is worth a swap
    min_records: int = 4  # held-out records before any decision: the t test needs a few
    min_positions: int = TrainerSettings.gate_min_positions  # and held-out positions

    def __post_init__(self) -> None:
        if not 0.5 <= self.confidence < 1:
            raise ValueError(f"confidence must be in [0.5, 1), got {self.confidence}")
        if self.min_records < 2 or self.min_positions < 1 or self.margin < 0:
            raise ValueError("min_records must be >= 2, min_positions >= 1 and margin >= 0")


def decide(candidate: RecordScores, champion: RecordScores, thresholds: Thresholds | None = None) -> Decision:
    """Promote or not, and why, in words an operator reads in the log and on the dashboard."""
    bar = thresholds or Thresholds()
    if candidate.records != champion.records or not np.array_equal(candidate.positions, champion.positions):
        return Decision(
            False,
            f"the two drafts were scored on different held-out records ({candidate.records} "
            f"vs {champion.records}); not compared",
        )
    records, positions = candidate.records, candidate.total_positions
    waiting = waiting_for(records, positions, bar)
    if waiting:
        return Decision(False, waiting, records=records, positions=positions)
    gain, se = paired_gain(candidate, champion)
    if se > 0:
        confidence = student_t_cdf((gain - bar.margin) / se, records - 1)
    else:  # every record gained by the same fraction of its positions: nothing to doubt
        confidence = 1.0 if gain > bar.margin else 0.0
    figures = dict(
        candidate=candidate.greedy_match,
        champion=champion.greedy_match,
        gain=gain,
        standard_error=se,
        confidence=confidence,
        records=records,
        positions=positions,
    )
    versus = (
        f"candidate {candidate.greedy_match:.3f} vs champion {champion.greedy_match:.3f} over {positions} "
        f"positions ({records} records), gain {gain:+.3f}"
    )
    if confidence < bar.confidence:
        return Decision(
            False,
            f"{versus}: {_percent(confidence)} confidence that it gains more than {bar.margin}, "
            f"needs {_percent(bar.confidence)}; not promoted",
            **figures,
        )
    if not candidate.expected_acceptance >= champion.expected_acceptance:
        return Decision(
            False,
            f"{versus}, {_percent(confidence)} confidence, but expected acceptance under "
            f"sampling fell ({candidate.expected_acceptance:.3f} vs "
            f"{champion.expected_acceptance:.3f}); not promoted",
            **figures,
        )
    return Decision(True, f"{versus}, {_percent(confidence)} confidence, promoted", **figures)


def waiting_for(records: int, positions: int, thresholds: Thresholds) -> str | None:
    """What the first decision waits for, "first candidate when the held-out set reaches 128 positions
    and 4 records: 64 positions in 2 records now", or None once the floors hold."""
    if records >= thresholds.min_records and positions >= thresholds.min_positions:
        return None
    return (
        f"first candidate when the held-out set reaches {thresholds.min_positions} positions and "
        f"{thresholds.min_records} records: {positions} positions in {records} records now"
    )


@dataclass(frozen=True)
class StatisticalGate:
    """The online trainer's gate (OnlineSettings.gate): `decide(candidate, champion)` on figures that carry
    their per-record scores (`.records`, trainer/promotion/champion.py `agreement`); the `Gate` of trainer/evaluation/gate.py
    with its fixed floor of positions replaced by `decide` above.

    `min_positions` and `margin` are read by the trainer (when to try a round, what to record with a
    promoted version), as on `Gate`.
    """

    thresholds: Thresholds = field(default_factory=Thresholds)

    @property
    def min_positions(self) -> int:
        return self.thresholds.min_positions

    @property
    def margin(self) -> float:
        return self.thresholds.margin

    def decide(self, candidate, champion) -> tuple[bool, str]:
        last = self.last_decision(candidate, champion)
        return last.promote, last.reason

    def waiting_for(self, records: int, positions: int) -> str | None:
        """What the first decision still waits for, or None once the floors hold."""
        return waiting_for(records, positions, self.thresholds)

    def last_decision(self, candidate, champion) -> Decision:
        scores = getattr(candidate, "records", None), getattr(champion, "records", None)
        if scores[0] is None or scores[1] is None:
            return Decision(False, "figures without per-record scores; the statistical gate cannot judge them")
        return decide(scores[0], scores[1], self.thresholds)


def student_t_cdf(t: float, dof: int) -> float:
    """P(T <= t) for Student's t with `dof` degrees of freedom: 1 - I_x(dof/2, 1/2) / 2 for t > 0,
    x = dof / (dof + t^2) (the regularized incomplete beta function). student_t_cdf(2.132, 4) = 0.95."""
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * _incomplete_beta(dof / 2, 0.5, dof / (dof + t * t))
    return 1.0 - tail if t > 0 else tail


def _incomplete_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b) by its continued fraction (Numerical Recipes §6.4, modified Lentz), to about 1e-12."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast only below this point: use the symmetry
        return 1.0 - _incomplete_beta(b, a, 1.0 - x)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 300):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= d * c
        if abs(d * c - 1.0) < 1e-13:
            break
    return front * fraction / a


def _percent(value: float) -> str:
    """0.973 -> "97%"; never rounds up to 100% or a passing figure: 0.9496 -> "94%"."""
    return f"{math.floor(value * 100)}%"
