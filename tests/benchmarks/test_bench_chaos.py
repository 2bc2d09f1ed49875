"""bench-chaos in brief: the whole fleet (Redis, an `mlflow server`, two replicas, a trainer) on the tiny model
for 24 s, the faults forced to bad records and a replica restart, a few seconds apart. The figures'
keys, the bar computed on them, and what these two faults must never cause: a request failed on both
replicas, a 5xx from a live replica, a record Redis acknowledged and lost.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/benchmarks/test_bench_chaos.py -q   (about a minute)
"""

from __future__ import annotations

import json

import pytest

from benchmarks.chaos import ChaosSettings, bar, plot, run_chaos, summary
from cli import main

pytestmark = [pytest.mark.redis, pytest.mark.slow]  # it starts a redis-server (and an mlflow server) of its own


def test_a_short_chaos_run_reports_every_figure_and_the_bar(tmp_path):
    settings = ChaosSettings(
        minutes=0.4,
        users=2,
        fault_gap_s=(6.0, 9.0),
        faults=("bad_records", "replica_restart"),
        settle_s=5.0,
        workdir=tmp_path / "fleet",
    )
    figures = run_chaos(settings)
    figures["bar"] = bar(figures)

    assert {"requests", "records", "versions", "swaps", "faults", "timeline", "bar", "unplanned_exits"} <= set(figures)
    assert {"sent", "answered", "failed_on_both", "5xx_from_a_live_replica"} <= set(figures["requests"])
    assert {"acknowledged_by_redis", "in_stream", "lost", "bad_injected"} <= set(figures["records"])
    assert {"promoted_by_the_trainer", "forged", "forged_refused_by_both", "rollback_races"} <= set(figures["versions"])
    assert set(figures["bar"]) == {
        "no acknowledged record lost",
        "no request failed on both replicas",
        "no 5xx from a live replica",
        "a version promoted",
        "every forged or NaN version refused by both replicas",
    }
    assert figures["faults"], "no fault was played"
    assert {fault["kind"] for fault in figures["faults"]} <= {"bad_records", "replica_restart"}
    assert all(fault["ok"] for fault in figures["faults"]), figures["faults"]

    requests, records = figures["requests"], figures["records"]
    assert requests["answered"] > 0 and requests["failed_on_both"] == 0, requests
    assert requests["5xx_from_a_live_replica"] == 0, requests["attempts"]
    assert records["acknowledged_by_redis"] > 0 and records["lost"] == 0, records
    assert figures["bar"]["no acknowledged record lost"] and figures["bar"]["no request failed on both replicas"]
    assert figures["timeline"] and figures["unplanned_exits"] == []

    json.dumps(figures)  # what --json writes
    assert "bar: no acknowledged record lost: yes" in summary(figures)
    plot(figures, tmp_path / "chaos.png")
    assert (tmp_path / "chaos.png").stat().st_size > 10_000


def test_an_unknown_fault_is_refused_before_anything_starts(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench-chaos", "--faults", "redis_kill,meteor"])
    assert exit_.value.code == 2
    assert "unknown fault meteor" in capsys.readouterr().err
