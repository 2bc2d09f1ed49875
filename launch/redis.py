"""A redis-server on loopback that this process starts and stops by its pid (launch/processes.py).

`adaptive-spec up`, `bench-drift`, the intake benchmark and the test suite use it when REDIS_URL is
not set:

    server = started_server(Path(tempfile.mkdtemp()))
    ... server.url ...            # redis://127.0.0.1:<free port>/0
    server.stop()

    with loopback_redis(workdir, log=print) as url:     # REDIS_URL when set, else a server started here
        ...

No persistence by default (`--save ""`, no AOF): the correction stream is a buffer, not a store of
record; `persist=True` keeps an append-only file (`up`, so a restart keeps the stream).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import redis

from adaptive_spec.contracts import REDIS_URL_ENV
from launch.processes import Child, free_port


class RedisStartError(RuntimeError):
    """redis-server could not be started here."""


class RedisNotInstalled(RedisStartError):
    pass


_running: set[RedisServer] = set()  # stopped at exit too, in case a fixture's teardown never ran


class RedisServer:
    """A redis-server child process on 127.0.0.1 with no persistence, controllable by the test."""

    def __init__(
        self,
        workdir: Path,
        port: int | None = None,
        *,
        persist: bool = False,
        password: str | None = None,
        maxmemory: str | None = None,
    ) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RedisNotInstalled(
                "redis-server is not installed (Debian: apt-get install redis-server; `./run` does this), "
                "or set REDIS_URL to a Redis you run"
            )
        self.workdir = Path(workdir).resolve()  # redis-server resolves --logfile after moving to --dir
        self.port = port or free_port()
        self.persist = persist  # append-only file in workdir, so a restart keeps the stream (adaptive-spec up)
        self.password = password  # requirepass; the url carries it
        self.maxmemory = maxmemory  # e.g. "2gb", with the policy noeviction: the stream is never evicted
        self.child: Child | None = None

    @property
    def process(self):
        """The running redis-server's Popen, or None."""
        return None if self.child is None else self.child.process

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 5.0) -> None:
        assert self.child is None, "already running"
        log_path = self.workdir / f"redis-{self.port}.log"
        command = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes" if self.persist else "no",
            "--dir",
            str(self.workdir),
            "--logfile",
            str(log_path),
        ]
        if self.password:
            command += ["--requirepass", self.password]
        if self.maxmemory:
            command += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "noeviction"]
        # Its own session: a Ctrl-C in the terminal reaches the parent, which stops Redis last, by pid.
        self.child = Child(command).start()
        _running.add(self)
        client = redis.Redis(
            host="127.0.0.1", port=self.port, password=self.password, socket_timeout=0.5, socket_connect_timeout=0.5
        )

        def answers() -> bool:
            try:
                return bool(client.ping())
            except redis.ConnectionError:  # refused connections are how a starting server looks
                return False

        try:
            self.child.wait_until(answers, timeout, "an answer to PING", interval=0.02)
        except RuntimeError:
            log = log_path.read_text() if log_path.exists() else ""
            self.stop()
            raise RedisStartError(f"redis-server on port {self.port} did not start:\n{log[-2000:]}") from None
        finally:
            client.close()

    def stop(self) -> None:
        """Stop the process this object started (by its pid) and wait for it."""
        self.resume()
        if self.child is not None:
            self.child.stop(5)
            self.child = None
        _running.discard(self)

    def restart(self) -> None:
        self.stop()
        self.start()

    def pause(self) -> None:
        """SIGSTOP: the port still accepts connections but nothing answers, like a stalled Redis."""
        assert self.child is not None
        self.child.signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.child is not None and self.child.running:
            self.child.signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL (no shutdown, no goodbye to clients), by the pid this object started."""
        assert self.child is not None
        self.child.signal(signal.SIGKILL)
        self.child.wait(5)
        self.child = None


@atexit.register
def _stop_leftovers() -> None:
    for server in list(_running):
        server.stop()


def started_server(
    workdir: Path, *, persist: bool = False, password: str | None = None, maxmemory: str | None = None
) -> RedisServer:
    """Start a server on a free port, trying again if another process took the port first."""
    for attempt in range(3):
        server = RedisServer(workdir, persist=persist, password=password, maxmemory=maxmemory)
        try:
            server.start()
            return server
        except RedisStartError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


@contextlib.contextmanager
def loopback_redis(workdir: Path, log: Callable[[str], None] | None = None) -> Iterator[str]:
    """REDIS_URL when it is set; else a redis-server started here on a free port, stopped on exit."""
    if os.environ.get(REDIS_URL_ENV):
        yield os.environ[REDIS_URL_ENV]
        return
    server = started_server(workdir)
    if log is not None:
        log(f"started redis-server on {server.url} (pid {server.child.pid if server.child else '?'})")
    try:
        yield server.url
    finally:
        server.stop()
