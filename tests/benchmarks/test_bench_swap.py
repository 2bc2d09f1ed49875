"""bench-swap on a tiny model: swaps between two random adapters under steady greedy traffic, with
every request answered and equal to the target alone (the pause figures are reported, not asserted).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/benchmarks/test_bench_swap.py -q
"""

from __future__ import annotations

import tempfile

import pytest
from tiny import tiny_target

from adaptive_spec import Engine
from adaptive_spec.drafters.spec import DraftSpecError
from benchmarks.swap import format_report, run_swap_bench

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def temp_root(tmp_path, monkeypatch):
    """tempfile's directory for the test, to see what a run leaves behind."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("draft", ["early-exit:1", "head"])
def test_swaps_under_traffic_fail_no_request_and_stay_lossless(draft, temp_root):
    engine = Engine(tiny_target(0), draft, eos_token_id=[])
    figures = run_swap_bench(
        engine, [[5, 17, 33, 8], [9, 2, 41]], swaps=3, clients=1, rank=4, max_new_tokens=8, interval_s=0.05
    )
    assert figures["swaps"] == 3 and figures["failed"] == 0 and figures["identical"] is True
    assert figures["requests"] > 0
    assert "swap pause (decoding held)" in format_report(figures)
    assert list(temp_root.iterdir()) == []  # the two adapters it wrote are gone


def test_it_needs_a_draft_with_weights(temp_root):
    with pytest.raises(DraftSpecError, match="early-exit:N and head drafts"):
        run_swap_bench(Engine(tiny_target(0), "ngram"), [[5, 17]], swaps=1)
    assert list(temp_root.iterdir()) == []
