"""A redis-server on loopback that this process starts and stops by its pid.

`adaptive-spec up`, `bench-drift` and the test suite use it when REDIS_URL is not set:

    server = started_server(Path(tempfile.mkdtemp()))
    ... server.url ...            # redis://127.0.0.1:<free port>/0
    server.stop()

No persistence (`--save ""`, no AOF): the correction stream is a buffer, not a store of record.
"""

from __future__ import annotations

import atexit
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis


class RedisStartError(RuntimeError):
    """redis-server could not be started here."""


class RedisNotInstalled(RedisStartError):
    pass


_running: set[RedisServer] = set()  # stopped at exit too, in case a fixture's teardown never ran


class RedisServer:
    """A redis-server child process on 127.0.0.1 with no persistence, controllable by the test."""

    def __init__(self, workdir: Path, port: int | None = None, *, persist: bool = False) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RedisNotInstalled(
                "redis-server is not installed (Debian: apt-get install redis-server; `./run` does this), "
                "or set REDIS_URL to a Redis you run"
            )
        self.workdir = Path(workdir).resolve()  # redis-server resolves --logfile after moving to --dir
        self.port = port or free_port()
        self.persist = persist  # append-only file in workdir, so a restart keeps the stream (adaptive-spec up)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 5.0) -> None:
        assert self.process is None, "already running"
        log_path = self.workdir / f"redis-{self.port}.log"
        command = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                   "--appendonly", "yes" if self.persist else "no", "--dir", str(self.workdir),
                   "--logfile", str(log_path)]  # fmt: skip
        # Its own session: a Ctrl-C in the terminal reaches the parent, which stops Redis last, by pid.
        self.process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True
        )
        _running.add(self)
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.process.poll() is not None:
                    log = log_path.read_text() if log_path.exists() else ""
                    self.process = None
                    raise RedisStartError(f"redis-server on port {self.port} exited at start:\n{log[-2000:]}")
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise RedisStartError(
                            f"redis-server on port {self.port} did not answer PING in {timeout} s"
                        ) from None  # refused connections are how a starting server looks
                    time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        """Stop the process this object started (by its pid) and wait for it."""
        self.resume()
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
            self.process = None
        _running.discard(self)

    def restart(self) -> None:
        self.stop()
        self.start()

    def pause(self) -> None:
        """SIGSTOP: the port still accepts connections but nothing answers, like a stalled Redis."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)


@atexit.register
def _stop_leftovers() -> None:
    for server in list(_running):
        server.stop()


def started_server(workdir: Path, *, persist: bool = False) -> RedisServer:
    """Start a server on a free port, trying again if another process took the port first."""
    for attempt in range(3):
        server = RedisServer(workdir, persist=persist)
        try:
            server.start()
            return server
        except RedisStartError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
