"""Bounded load on loopback: `adaptive-spec bench-load` against a tiny server, and the same load client
through two adapter swaps and a Redis restart. Correctness only: 0 errors outside the documented
429/503; the figures are printed, never asserted (a benchmark is not a test).

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/reliability/test_load.py -q -s   (about 40 s)
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from registry_support import write_adapter
from support import BackgroundLoad, child_env, eventually, kill_redis, tiny_target

from registry.client import AdapterRegistry

pytestmark = pytest.mark.redis


def test_bench_load_command_reports_no_errors(serve_process, redis_url, tmp_path):
    with serve_process(env={"REDIS_URL": redis_url}) as server:
        command = [
            sys.executable,
            "-m",
            "cli",
            "bench-load",
            "--url",
            server.url,
            "--users",
            "4",
            "--duration-s",
            "5",
            "--max-tokens",
            "16",
            "--prompt",
            "Name three rivers.",
            "--json",
            str(tmp_path / "load.json"),
        ]
        done = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=120)
    print("\n" + done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads((tmp_path / "load.json").read_text())
    assert figures["errors"] == 0 and figures["requests"] > 0
    assert figures["by_status"].get("200", 0) + figures["by_status"].get("429", 0) == figures["requests"]
    assert set(figures["latency_s"]) == {"p50", "p99", "max"} and figures["throughput_rps"] > 0


def test_load_through_adapter_swaps_and_a_redis_restart(serve_process, redis_server, tiny_model_dir, tmp_path):
    target = tiny_target(0)
    adapters = [
        write_adapter(target, 1, tmp_path / f"v000{i}", seed=i, version=i, target_id=str(tiny_model_dir))
        for i in (1, 2)
    ]
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    registry = AdapterRegistry(store, data_dir=tmp_path, redis_url=redis_server.url)
    env = {"REDIS_URL": redis_server.url, "MLFLOW_TRACKING_URI": store, "ADAPTIVE_SPEC_ADAPTER_POLL_S": "0.5"}
    with serve_process(env=env) as server:
        with BackgroundLoad(server.url, users=4, max_tokens=16) as load:
            time.sleep(2)
            registry.register(adapters[0], by="test")
            eventually(lambda: server.health()["adapter_version"] == "1", 30, "the swap to version 1")
            time.sleep(1)
            kill_redis(redis_server)
            time.sleep(2)
            redis_server.start()
            registry.register(adapters[1], by="test")  # its pub/sub event goes to a fresh Redis
            eventually(lambda: server.health()["adapter_version"] == "2", 30, "the swap to version 2")
            time.sleep(2)
        counts = eventually(
            lambda: (c := server.health()["correction_log"])["queue_depth"] == 0 and c, 15, "the writer to drain"
        )
        swaps = server.metric("adaptive_spec:adapter_swaps_total")
    report = load.report
    print(f"\n{report.summary()}\ncorrection log: {counts}; swaps {swaps:.0f}")
    assert report.errors == 0, report.as_dict()
    assert set(report.by_status) <= {200, 429} and report.by_status[200] > 0
    assert set(report.adapter_versions) == {"base", "1", "2"}
    assert swaps == 2
    assert counts["written"] + counts["dropped"] == counts["submitted"] == report.by_status[200]
