"""A child process started, health-checked and stopped by its own pid: what `adaptive-spec up`, the
benchmarks that start servers and trainers, and the test harnesses share.

    server = Child([sys.executable, "-m", "cli", "serve", "--port", str(port)], log_path=workdir / "serve.log")
    server.start()
    server.wait_until(lambda: http_ok(f"http://127.0.0.1:{port}/health"), 600, "/health")
    ...
    server.stop(60)        # SIGTERM, then SIGKILL after 60 s

`wait_until` fails with the tail of the child's log when the child exits first or time runs out, so
a server that cannot start says why in the error. Children run in their own session by default: a
Ctrl-C in the terminal reaches only the parent, which stops them in the order it chooses (up stops
the trainer, then Redis). `group=True` stops the child's whole process group (a command that
starts workers of its own, such as `mlflow server`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path


class ChildFailed(RuntimeError):
    """The child exited, or did not become ready in time; the message ends with its log's tail."""


class Child:
    """One command as a child process, its output appended to `log_path` (None: discarded)."""

    def __init__(
        self,
        command: list[str],
        log_path: Path | None = None,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        new_session: bool = True,
        group: bool = False,
    ) -> None:
        self.command = [str(part) for part in command]
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.new_session = new_session or group
        self.group = group
        self.process: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None, "not started"
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> Child:
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab") if self.log_path is not None else None  # noqa: SIM115 # closed below; the child keeps its own descriptor
        try:
            self.process = subprocess.Popen(
                self.command,
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL if log is None else log,
                stderr=subprocess.STDOUT,
                start_new_session=self.new_session,
            )
        finally:
            if log is not None:
                log.close()
        return self

    def wait_until(self, ready: Callable[[], bool], timeout: float, what: str, *, interval: float = 0.1) -> None:
        """Poll `ready()` until it is true; ChildFailed (with the log's tail) if the child exits first or
        `timeout` seconds pass, after stopping it."""
        deadline = time.monotonic() + timeout
        while True:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise ChildFailed(f"{self.name} exited with {code} before {what}:\n{self.log_tail()}")
            if ready():
                return
            if time.monotonic() > deadline:
                self.stop()
                raise ChildFailed(f"{self.name}: no {what} within {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(interval)

    def signal(self, signum: int) -> None:
        assert self.process is not None, "not started"
        if self.group:
            os.killpg(self.process.pid, signum)
        else:
            self.process.send_signal(signum)

    def wait(self, timeout: float | None = None) -> int:
        assert self.process is not None, "not started"
        return self.process.wait(timeout)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout` seconds; returns the exit code (None if never started)."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            try:
                self.signal(signal.SIGTERM)
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.process.wait(5)
            except ProcessLookupError:  # the group ended between the poll and the signal
                self.process.wait(5)
        return self.process.returncode

    @property
    def name(self) -> str:
        return Path(self.command[0]).name if self.log_path is None else self.log_path.stem

    def log(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def log_tail(self, chars: int = 3000) -> str:
        return self.log()[-chars:]


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """True when GET `url` answers 200 (a health check); False on any other answer or no answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except OSError:  # refused, reset, timed out, or an HTTP error status
        return False


def free_port() -> int:
    """A TCP port free on loopback now (another process may take it before it is used: retry then)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def child_env(drop: Iterable[str] = (), **extra: str) -> dict[str, str]:
    """This process's environment without `drop` (what would point a child elsewhere), plus `extra`."""
    dropped = set(drop)
    return {**{key: value for key, value in os.environ.items() if key not in dropped}, **extra}
