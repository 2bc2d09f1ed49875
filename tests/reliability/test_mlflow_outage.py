"""The MLflow server goes down while a promotion is on its way: serving goes on with the adapter it has,
the promotion waits and is retried, and it lands in the running server when MLflow returns
(DESIGN.md "MLflow down").

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/reliability/test_mlflow_outage.py -q -s   (about 60 s)

Real parts: `mlflow server` (launch/mlflow.py, stopped and restarted on the same port and
database), `adaptive-spec serve` as a child process whose watcher follows the champion alias on
that server (poll 0.5 s, plus the Redis pub/sub event), a redis-server, and closed-loop HTTP
traffic throughout. The trainer's side is PendingRegistrations, as `adaptive-spec train` builds it;
tests/registry/test_registry.py shows the same queue inside the real trainer process.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from registry_support import MlflowServer, write_adapter
from support import BackgroundLoad, eventually, tiny_target

from registry.client import AdapterRegistry
from trainer.promotion.pending import PendingRegistrations

pytestmark = pytest.mark.redis


def test_promotion_during_an_mlflow_outage_lands_when_it_returns(
    serve_process, redis_url, tiny_model_dir, tmp_path, monkeypatch
):
    # Each registry call fails at once while MLflow is down, rather than after MLflow's two retries (about
    # 2.5 s a call: the watcher took some 16 s to notice the outage); what is tested is what comes after.
    # An operator's value wins (registry/connection.py), here and in the server, which inherits it.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    target = tiny_target(0)
    adapters = [
        write_adapter(target, 1, tmp_path / f"v000{i}", seed=i, version=i, target_id=str(tiny_model_dir))
        for i in (1, 2)
    ]
    mlflow = MlflowServer(tmp_path)
    mlflow.start()
    try:
        registry = AdapterRegistry(mlflow.url, data_dir=tmp_path, redis_url=redis_url)
        assert registry.register(adapters[0], by="test") == "1"
        env = {"MLFLOW_TRACKING_URI": mlflow.url, "REDIS_URL": redis_url, "ADAPTIVE_SPEC_ADAPTER_POLL_S": "0.5"}
        with serve_process(env=env) as server:
            eventually(lambda: server.health()["adapter_version"] == "1", 30, "the server to serve version 1")
            with BackgroundLoad(server.url) as load:
                mlflow.stop()
                pending = PendingRegistrations(
                    registry, tmp_path / "pending.json", by="trainer:test", retry_s=0.5
                ).start()
                started = time.monotonic()
                pending.submit(SimpleNamespace(path=adapters[1]))  # what the trainer's on_promote does
                assert time.monotonic() - started < 0.5, "the trainer must not wait for MLflow"
                eventually(lambda: pending.failures >= 2, 30, "the registration to be tried and retried")
                eventually(
                    lambda: server.metric("adaptive_spec:adapter_registry_errors_total") >= 1,
                    30,
                    "the watcher to notice the outage",
                )
                outage_errors = server.metric("adaptive_spec:adapter_registry_errors_total")
                served_during_outage = server.health()["adapter_version"]
                mlflow.start()
                eventually(lambda: not pending.pending(), 60, "the queued registration to land")
                eventually(lambda: server.health()["adapter_version"] == "2", 30, "the server to swap to version 2")
                time.sleep(0.5)  # some traffic on version 2
            left = pending.stop()
            swaps = server.metric("adaptive_spec:adapter_swaps_total")
        aliases = registry.aliases()
    finally:
        mlflow.stop()

    report = load.report
    print(
        f"\n{report.summary()}\nregistration attempts that failed: {pending.failures}; watcher registry errors "
        f"during the outage: {outage_errors:.0f}; registered {pending.registered}; swaps {swaps:.0f}"
    )
    assert served_during_outage == "1"
    assert report.errors == 0 and set(report.by_status) == {200}, report.as_dict()
    assert set(report.adapter_versions) == {"1", "2"}  # served 1 through the outage, then 2
    assert pending.registered == ["2"] and left == 0
    assert aliases == {"champion": "2", "previous": "1"}
    assert swaps == 2
