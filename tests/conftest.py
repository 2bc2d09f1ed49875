"""Shared fixtures. Redis tests use a real redis-server, never a fake.

    cd /work/main && .venv/bin/python -m pytest tests -q

`redis_url` uses $REDIS_URL when set, else starts one redis-server on a free loopback port for
the whole session. `redis_client` FLUSHDBs that database before each test, so a $REDIS_URL
given to the tests must name a disposable database. `redis_server` starts a private
redis-server that a test may stop, pause and restart on the same port (fault tests); it
always runs locally, whatever $REDIS_URL says.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from adaptive_spec.record import CorrectionRecord

_running: set[RedisServer] = set()  # stopped at exit too, in case a fixture's teardown never ran


class RedisServer:
    """A redis-server child process on 127.0.0.1 with no persistence, controllable by the test."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            pytest.fail(
                "redis-server is not installed; the Redis tests need a real server "
                "(Debian: apt-get install redis-server), or set REDIS_URL to a disposable database",
                pytrace=False,
            )
        self.workdir = workdir
        self.port = port or _free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 5.0) -> None:
        assert self.process is None, "already running"
        log_path = self.workdir / f"redis-{self.port}.log"
        command = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                   "--dir", str(self.workdir), "--logfile", str(log_path)]  # fmt: skip
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        _running.add(self)
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.process.poll() is not None:
                    log = log_path.read_text() if log_path.exists() else ""
                    self.process = None
                    raise RuntimeError(f"redis-server on port {self.port} exited at start:\n{log[-2000:]}")
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(f"redis-server on port {self.port} did not answer PING in {timeout} s")
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


def _started_server(workdir: Path) -> RedisServer:
    """Start a server on a free port, trying again if another process took the port first."""
    for attempt in range(3):
        server = RedisServer(workdir)
        try:
            server.start()
            return server
        except RuntimeError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    with tempfile.TemporaryDirectory(prefix="adaptive-spec-redis-") as workdir:
        server = _started_server(Path(workdir))
        try:
            yield server.url
        finally:
            server.stop()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A started private redis-server that the test may stop(), pause() and restart() on its port."""
    server = _started_server(tmp_path)
    try:
        yield server
    finally:
        server.stop()


def random_record(seed: int = 0, n_out: int = 24, m: int = 16, n_prompt: int = 12, vocab: int = 49152,
                  request_id: str | None = None) -> CorrectionRecord:  # fmt: skip
    """A consistent random record: about half the positions drafted, some of those accepted."""
    rng = np.random.default_rng(seed)
    output_ids = rng.integers(0, vocab, n_out)  # [n_out]
    drafted = rng.random(n_out) < 0.5  # [n_out]
    accepted = drafted & (rng.random(n_out) < 0.5)  # [n_out]
    proposed = np.where(accepted, output_ids, rng.integers(0, vocab, n_out))  # [n_out]
    return CorrectionRecord(
        request_id=request_id or f"req-{seed}",
        created_at=1_700_000_000.0 + seed + rng.random(),
        domain=["json", None, "code"][seed % 3],
        target_id="smollm2-135m-instruct",
        draft_id="early-exit:4",
        adapter_version=None if seed % 2 else str(seed),
        temperature=[0.0, 0.7, 1.0][seed % 3],
        prompt_ids=rng.integers(0, vocab, n_prompt).tolist(),
        output_ids=output_ids.tolist(),
        proposed=np.where(drafted, proposed, -1).tolist(),
        accepted=accepted.tolist(),
        target_topk_ids=rng.integers(0, vocab, (n_out, m)),  # [n_out, m]
        target_topk_logprobs=-rng.exponential(3.0, (n_out, m)),  # [n_out, m]
    )


@pytest.fixture
def make_record():
    """random_record(seed, n_out=..., m=..., ...) for tests outside this file."""
    return random_record
