"""Helpers for the registry and watcher tests: a real `mlflow server` on a free loopback port that a test
may stop and restart (adapters written as the trainer writes them are in adapter_files.py).

    from registry_support import MlflowServer, write_adapter
    server = MlflowServer(tmp_path); server.start(); ...; server.stop(); server.start()   # same port, same db
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from adapter_files import write_adapter  # noqa: F401  (the registry tests take it from here)

from launch.redis import free_port


class MlflowServer:
    """`mlflow server` with a sqlite backend and served artifacts in `workdir`, in its own process group."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

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
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.log_path = self.workdir / f"mlflow-server-{self.port}.log"
        with open(self.log_path, "ab") as log:  # the server keeps its own copy of the descriptor
            self.process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, start_new_session=True
            )  # its uvicorn child joins the group we stop
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.process.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"mlflow server did not answer on {self.url} within {timeout} s")

    def stop(self) -> None:
        """Stop the server's process group (the mlflow CLI and its uvicorn worker), by the pid we started."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(5)
        except ProcessLookupError:
            pass
        self.process = None
