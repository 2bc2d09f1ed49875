"""An `mlflow server` on loopback that this process starts and stops by its process group (launch/processes.py):
what `adaptive-spec bench-chaos` and the tests run as a fleet's registry.

    server = MlflowServer(workdir); server.start(); ... server.url ...; server.stop(); server.start()  # same port, db

The backend is a sqlite file and the artifacts a directory, both in `workdir`, so a restart keeps every
version. The server runs one worker in its own process group (the mlflow command and its uvicorn worker,
stopped together).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from launch.processes import Child, free_port, http_ok


class MlflowServer:
    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.workdir = Path(workdir)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.child: Child | None = None
        self.log_path = self.workdir / f"mlflow-server-{self.port}.log"

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
        self.child = Child(command, self.log_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, group=True).start()
        self.child.wait_until(lambda: http_ok(self.url + "/health", timeout=1), timeout, f"mlflow server on {self.url}")

    def stop(self) -> None:
        """Stop the server's process group (the mlflow CLI and its uvicorn worker), by the pid we started."""
        if self.child is not None:
            self.child.stop(15)
            self.child = None
