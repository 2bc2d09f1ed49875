"""The statistical gate (trainer/evaluation/decision.py): a worse or equal candidate is never promoted, a clearly
better one is promoted early, and it says what it waits for.

Run: .venv/bin/python -m pytest tests/trainer/test_decision.py -q   (no model, a few seconds)

The simulated traffic: records of 16-96 positions, each with its own difficulty (the champion's
chance to match the target, Beta(2, 5), mean 0.29). A candidate redraws 30% of the positions from the
same chance (an equal candidate that still disagrees with the champion) and, for a true gain g,
turns misses into hits (or hits into misses) on the others until its expected gain is g. The
trainer looks after every round, and a lineage's first round also at every held-out record that
arrives while it trains (trainer/loop/online.py `_FirstLook`), so every run looks after 4, 5, ..., 40
held-out records and stops at the first promotion, as the trainer would.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from trainer.evaluation.decision import RecordScores, StatisticalGate, Thresholds, decide, paired_gain, student_t_cdf
from trainer.evaluation.gate import GateFigures

LOOKS = range(4, 41)
SEEDS = range(300)


def simulated_run(seed: int, gain: float, thresholds: Thresholds) -> int | None:
    """Held-out positions at the first promotion over the looks, or None if never promoted."""
    rng = np.random.default_rng(seed)
    records = max(LOOKS)
    sizes = rng.integers(16, 97, records)
    chances = rng.beta(2, 5, records)
    champion, candidate = [], []
    for size, chance in zip(sizes, chances, strict=True):
        hits = rng.random(size) < chance  # the champion's matches
        redrawn = rng.random(size) < 0.3
        mine = np.where(redrawn, rng.random(size) < chance, hits)
        if gain > 0:  # misses become hits with the chance that makes the expected gain `gain`
            mine = np.where(~mine & (rng.random(size) < gain / (1 - chance)), True, mine)
        elif gain < 0:
            mine = np.where(mine & (rng.random(size) < -gain / chance), False, mine)
        champion.append(hits)
        candidate.append(mine)
    for look in LOOKS:
        positions = sizes[:look]
        scores = [
            RecordScores([int(h.sum()) for h in side[:look]], [float(h.sum()) for h in side[:look]], positions)
            for side in (candidate, champion)
        ]
        if decide(scores[0], scores[1], thresholds).promote:
            return int(positions.sum())
    return None


@pytest.mark.parametrize("gain", [-0.05, -0.02, 0.0])
def test_a_worse_or_equal_candidate_is_never_promoted_across_many_seeds(gain):
    promoted = [seed for seed in SEEDS if simulated_run(seed, gain, Thresholds()) is not None]
    assert promoted == []


def test_the_same_runs_at_a_laxer_confidence_do_promote_equal_candidates():
    """The seeds above are not a lucky set: at 0.95 and a 0.01 margin, equal candidates get through."""
    lax = Thresholds(confidence=0.95, margin=0.01)
    assert sum(simulated_run(seed, 0.0, lax) is not None for seed in SEEDS) >= 5


def test_a_clearly_better_candidate_is_promoted_early_and_a_small_gain_waits():
    large = [simulated_run(seed, 0.2, Thresholds()) for seed in SEEDS]
    assert all(positions is not None for positions in large)
    assert np.median(large) < 500  # a few hundred positions, against the fixed gate's 1000
    moderate = [simulated_run(seed, 0.06, Thresholds()) for seed in range(100)]
    waited = [positions for positions in moderate if positions is not None]
    assert np.median(waited) > np.median(large)


def test_the_student_t_distribution_matches_scipy():
    for dof in (1, 2, 3, 5, 8, 30, 200):
        for t in (-6.0, -2.0, -0.3, 0.0, 0.4, 1.0, 2.132, 3.5, 12.0):
            assert student_t_cdf(t, dof) == pytest.approx(stats.t.cdf(t, dof), abs=1e-9)
    assert student_t_cdf(math.inf, 3) == 1.0 and student_t_cdf(-math.inf, 3) == 0.0


def test_paired_gain_and_its_standard_error_by_hand():
    candidate = RecordScores(matched=[6, 3, 8], expected=[6.0, 3.0, 8.0], positions=[10, 10, 20])
    champion = RecordScores(matched=[2, 3, 4], expected=[2.0, 3.0, 4.0], positions=[10, 10, 20])
    gain, se = paired_gain(candidate, champion)
    assert gain == pytest.approx(8 / 40)
    residuals = np.array([4, 0, 4]) - gain * np.array([10, 10, 20])  # [2, -2, 0]
    assert se == pytest.approx(math.sqrt(3 / 2 * float((residuals**2).sum())) / 40)
    _, alone = paired_gain(RecordScores([1], [1.0], [5]), RecordScores([0], [0.0], [5]))
    assert math.isnan(alone)


def test_it_waits_for_its_floors_and_says_so():
    gate = StatisticalGate()
    assert gate.waiting_for(2, 64) == (
        "first candidate when the held-out set reaches 128 positions and 4 records: 64 positions in 2 records now"
    )
    assert gate.waiting_for(4, 128) is None
    few = RecordScores([9, 9], [9.0, 9.0], [10, 10])
    none = RecordScores([0, 0], [0.0, 0.0], [10, 10])
    decision = decide(few, none)
    assert not decision.promote and decision.reason.startswith("first candidate when")


def test_the_reason_gives_both_figures_and_the_confidence():
    rng = np.random.default_rng(0)
    sizes = rng.integers(30, 60, 12)
    champion = RecordScores((sizes * 0.1).astype(int), sizes * 0.1, sizes)
    candidate = RecordScores((sizes * 0.4).astype(int) + rng.integers(0, 3, 12), sizes * 0.4, sizes)
    promoted, reason = StatisticalGate().decide(
        GateFigures(candidate.expected_acceptance, candidate.greedy_match, candidate.total_positions, candidate),
        GateFigures(champion.expected_acceptance, champion.greedy_match, champion.total_positions, champion),
    )
    assert promoted
    assert reason.startswith(f"candidate {candidate.greedy_match:.3f} vs champion {champion.greedy_match:.3f}")
    assert reason.endswith("confidence, promoted") and "99%" in reason


def test_a_candidate_whose_expected_acceptance_fell_is_not_promoted():
    sizes = np.full(10, 40)
    champion = RecordScores(np.full(10, 4), np.full(10, 30.0), sizes)
    candidate = RecordScores(np.full(10, 20), np.full(10, 20.0), sizes)
    decision = decide(candidate, champion)
    assert not decision.promote and "expected acceptance under sampling fell" in decision.reason


def test_scores_of_different_records_are_not_compared():
    one = RecordScores([5, 5, 5, 5], [5.0] * 4, [10, 10, 10, 10])
    other = RecordScores([0, 0, 0, 0], [0.0] * 4, [10, 10, 10, 12])
    assert "different held-out records" in decide(one, other).reason
    without = GateFigures(0.5, 0.5, 40)
    assert not StatisticalGate().decide(without, without)[0]


@pytest.mark.parametrize("confidence,min_records", [(0.4, 4), (1.0, 4), (0.95, 1)])
def test_thresholds_refuse_nonsense(confidence, min_records):
    with pytest.raises(ValueError):
        Thresholds(confidence=confidence, min_records=min_records)
