"""Processes started together on one new MLflow sqlite store all come up and read it (MLflow creates a new store's tables with no guard of its own), and a
server whose registry cannot be reached serves anyway (DESIGN.md "MLflow down").

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/reliability/test_shared_store.py -q   (about 60 s)

Real parts: `adaptive-spec serve` child processes on the tiny model, each with its watcher following
the champion alias, and `adaptive-spec adapters list`, all launched in the same instant on a sqlite
file that does not exist yet. Before registry/mlflow_store.py, MLflow created the tables in every
process at once and the slower ones died ("table datasets already exists"): 12 of 15 processes in
5 rounds of 3 opening the registry together.
"""

from __future__ import annotations

import sys

import httpx
import pytest
from support import ChildProcess, ServeProcess, child_env

from adaptive_spec.contracts import MLFLOW_TRACKING_URI_ENV
from launch.processes import free_port

# The race hit 4 processes in 5, so one round of 4 processes (3 servers and the CLI) misses it with p = 0.2 ** 4
# = 0.0016; a second round (0.000003) cost 18 s of a suite at its 20-minute line. Each round is a new store.
ROUNDS = 1
SERVERS = 3
TOKEN = "shared-store-admin-token"


def _admin_adapters(server: ServeProcess) -> httpx.Response:
    return httpx.get(server.url + "/admin/adapters", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_servers_and_a_cli_started_together_on_a_new_sqlite_store_all_come_up(round_, tmp_path, tiny_model_dir):
    database = tmp_path / "data" / "mlflow.db"
    env = {
        MLFLOW_TRACKING_URI_ENV: f"sqlite:///{database}",
        "ADAPTIVE_SPEC_ADMIN_TOKEN": TOKEN,
        "ADAPTIVE_SPEC_ADAPTER_POLL_S": "0.5",
    }
    assert not database.exists()
    servers = [ServeProcess(tmp_path, tiny_model_dir, env, []) for _ in range(SERVERS)]
    cli = ChildProcess(
        [sys.executable, "-m", "cli", "adapters", "list", "--json"],
        tmp_path,
        child_env(**env),
        "adapters-list",
    )
    children = [*servers, cli]
    try:
        for child in children:
            child.launch()
        for server in servers:
            server.wait_until(server.ready, 180, f"/health on {server.url}")
        for server in servers:
            assert server.health()["status"] == "ok"
            listed = _admin_adapters(server)
            assert listed.status_code == 200, listed.text
            assert listed.json()["aliases"] == {} and listed.json()["data"] == []
        assert cli.wait(120) == 0, cli.log()
        assert cli.log().rstrip().endswith("[]"), cli.log()  # no versions yet, read from the store
        for server in servers:
            log = server.log()
            assert "already exists" not in log and "Traceback" not in log, log[-3000:]
    finally:
        for child in children:
            child.stop()


def test_a_server_whose_registry_cannot_be_reached_serves_anyway(tmp_path, tiny_model_dir):
    nobody = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = {MLFLOW_TRACKING_URI_ENV: nobody, "ADAPTIVE_SPEC_ADMIN_TOKEN": TOKEN, "ADAPTIVE_SPEC_ADAPTER_POLL_S": "0.5"}
    server = ServeProcess(tmp_path, tiny_model_dir, env, [])
    server.start()
    try:
        reply = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert server.health()["adapter_version"] is None
        listed = _admin_adapters(server)
        assert listed.status_code == 503 and listed.json()["error"]["code"] == "registry_unavailable", listed.text
    finally:
        server.stop()
