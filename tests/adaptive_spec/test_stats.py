"""The figures every report derives from step sums (adaptive_spec/formats/stats.py), on its docstring's examples.

Run: .venv/bin/python -m pytest tests/adaptive_spec/test_stats.py -q
"""

from __future__ import annotations

import pytest

from adaptive_spec.formats.stats import RequestStats, StepStats, Totals


def step(drafted: int, accepted: int, reach: int | None = None) -> StepStats:
    return StepStats(drafted, accepted, accepted + 1, 1, 0.0, 0.0, reach=reach)


def test_the_docstring_example_ten_chains_of_four() -> None:
    stats = RequestStats()
    for accepted in [3] * 10:
        stats.add(step(4, accepted))
    assert stats.acceptance_rate == 0.75 and stats.mean_acceptance_length == 4.0
    assert stats.tokens_verified_per_step == 4.0
    assert stats.drafted_per_pos == [10, 10, 10, 10] and stats.accepted_per_pos == [10, 10, 10, 0]
    assert stats.acceptance_by_depth == [1.0, 1.0, 1.0, 0.0]


def test_a_tree_counts_its_nodes_as_verified_and_its_depths_as_reached() -> None:
    """12 nodes, 4 deep: 12 tokens verified, depths 1-4 reached; a chain of 4 reaches the same depths."""
    tree, chain = RequestStats(), RequestStats()
    tree.add(step(12, 2, reach=4))
    chain.add(step(4, 2))
    assert tree.drafted_per_pos == chain.drafted_per_pos == [1, 1, 1, 1]
    assert tree.acceptance_by_depth == chain.acceptance_by_depth == [1.0, 1.0, 0.0, 0.0]
    assert tree.tokens_verified_per_step == 12.0 and chain.tokens_verified_per_step == 4.0
    assert tree.acceptance_rate == pytest.approx(2 / 12) and chain.acceptance_rate == 0.5


def test_totals_add_depths_of_different_lengths() -> None:
    short, long = RequestStats(), RequestStats()
    short.add(step(1, 1))
    long.add(step(3, 0))
    both = Totals().include(short).include(long)
    assert both.drafted_per_pos == [2, 1, 1] and both.accepted_per_pos == [1, 0, 0]
    assert both.acceptance_by_depth == [0.5, 0.0, 0.0]
    assert both.figures() == {
        "acceptance_rate": 0.25,
        "mean_acceptance_length": 1.5,
        "tokens_verified_per_step": 2.0,
        "acceptance_by_depth": [0.5, 0.0, 0.0],
    }
    assert Totals().figures()["tokens_verified_per_step"] is None and Totals().acceptance_by_depth == []
