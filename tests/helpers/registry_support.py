"""Helpers for the registry and watcher tests: a real `mlflow server` on a free loopback port that a test
may stop and restart (adapters written as the trainer writes them are in adapter_files.py).

    from registry_support import MlflowServer, write_adapter
    server = MlflowServer(tmp_path); server.start(); ...; server.stop(); server.start()   # same port, same db
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from adapter_files import write_adapter  # noqa: F401  (the registry tests take it from here)

from launch.processes import Child, free_port, http_ok


class MlflowServer:
    """`mlflow server` with a sqlite backend and served artifacts in `workdir`, in its own process group
    (the mlflow command and its uvicorn worker, stopped together: launch/processes.py)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.child: Child | None = None

    @property
    def process(self):
        return None if self.child is None else self.child.process

    def start(self, timeout: float = 90.0) -> None:
        mlflow = Path(sys.executable).with_name("mlflow")
        command = [
            str(mlflow),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{self.workdir / 'server.db'}",
            "--artifacts-destination",
            str(self.workdir / "server-artifacts"),
        ]
        self.log_path = self.workdir / f"mlflow-server-{self.port}.log"
        self.child = Child(command, self.log_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, group=True).start()
        self.child.wait_until(lambda: http_ok(self.url + "/health", timeout=1), timeout, f"mlflow server on {self.url}")

    def stop(self) -> None:
        """Stop the server's process group (the mlflow CLI and its uvicorn worker), by the pid we started."""
        if self.child is not None:
            self.child.stop(15)
            self.child = None
