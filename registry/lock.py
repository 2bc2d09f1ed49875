"""One alias move at a time: the lock every promote and rollback of a registered model holds, whoever
makes it (the trainer's queue, `adaptive-spec adapters`, the admin API of any replica, every domain).

    lock = AliasLock(tracking_uri, redis_url, "adaptive-spec-draft")
    with lock.held("rollback"):        # RegistryUnavailable when it cannot be had within `wait_s`
        ... read the aliases, decide, move them, read them back ...

Why: a move is several MLflow calls (read the aliases, tag the version, set `previous`, set `champion`,
record the event). Two moves that interleave end in a state neither asked for. Seen: a CLI rollback
5 -> 4 overlapping a queued promotion of 6 (trained from 5) ended with 6 served and `previous` deleted,
while the CLI printed "champion 5 -> 4". Under the lock, every move (its checks included, such as the
queue's "is my parent still the champion?") sees the aliases as the last move left them, so the end state
is always that of the moves made one after the other, and each reports what it did.

Which lock, by where the aliases live:

- a sqlite store (`sqlite:///.../mlflow.db`, `adaptive-spec up`): an exclusive `flock` on the file
  `mlflow.db.aliases.lock` beside it. Every process that opens that store runs on this machine; the
  kernel releases the lock when its holder dies, however.
- any other store (an `mlflow server`) with Redis: the key `adaptive_spec:registry_lock:<model>`, taken
  with `SET NX PX` (30 s, `TTL_S`, longer than any move) and deleted only by its holder. A holder that dies
  mid-move blocks the others for the rest of its ttl at most. Every fleet process has REDIS_URL; give it
  to `adaptive-spec adapters` too.
- an `mlflow server` without Redis: only this process's moves are serialised; a warning says so once.

Tests: `.venv/bin/python -m pytest tests/registry/test_alias_race.py -q`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from adaptive_spec.contracts import REGISTRY_LOCK_PREFIX, redact_url
from registry.mlflow_store import sqlite_path

log = logging.getLogger(__name__)

TTL_S = 30.0  # a Redis lock outlives its holder by this much at most
WAIT_S = 60.0  # how long a move waits for the lock before it gives up (RegistryUnavailable)
_POLL_S = 0.05
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
_local_locks: dict[str, threading.Lock] = {}
_warned: set[str] = set()


class LockUnavailable(RuntimeError):
    """The lock could not be had: its store did not answer, or another mover held it for `wait_s`."""


class AliasLock:
    def __init__(self, tracking_uri: str, redis_url: str | None, model_name: str, *, wait_s: float = WAIT_S) -> None:
        self.model_name = model_name
        self.wait_s = wait_s
        self.database = sqlite_path(tracking_uri)
        self.redis_url = None if self.database is not None else redis_url
        self.tracking_uri = tracking_uri

    @property
    def kind(self) -> str:
        """ "file", "redis" or "process": what serialises the moves (the module docstring says when)."""
        return "file" if self.database is not None else "redis" if self.redis_url else "process"

    @contextlib.contextmanager
    def held(self, what: str) -> Iterator[None]:
        """Hold the lock for one move; LockUnavailable when it cannot be had."""
        if self.database is not None:
            with self._file():
                yield
        elif self.redis_url:
            with self._redis(what):
                yield
        else:
            if self.tracking_uri not in _warned:
                _warned.add(self.tracking_uri)
                log.warning(
                    "alias moves on %s are serialised within this process only: set REDIS_URL (the fleet's Redis) "
                    "so that this process, the trainer and every replica take one lock",
                    redact_url(self.tracking_uri),
                )
            with _local_locks.setdefault(self.tracking_uri + "|" + self.model_name, threading.Lock()):
                yield

    @contextlib.contextmanager
    def _file(self) -> Iterator[None]:
        import fcntl

        assert self.database is not None
        self.database.parent.mkdir(parents=True, exist_ok=True)
        path = Path(str(self.database) + ".aliases.lock")
        deadline = time.monotonic() + self.wait_s
        with open(path, "a") as handle:  # one open file per holder: flock serialises threads alike
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise LockUnavailable(f"{path} was held for {self.wait_s:.0f} s by another move") from None
                    time.sleep(_POLL_S)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def _redis(self, what: str) -> Iterator[None]:
        import redis

        assert self.redis_url is not None
        key, token = REGISTRY_LOCK_PREFIX + self.model_name, f"{what}:{uuid.uuid4().hex}"
        client = redis.Redis.from_url(self.redis_url, socket_timeout=5.0, socket_connect_timeout=5.0)
        try:
            deadline = time.monotonic() + self.wait_s
            try:
                while not client.set(key, token, nx=True, px=int(TTL_S * 1000)):
                    if time.monotonic() > deadline:
                        holder = client.get(key)
                        raise LockUnavailable(f"{key} was held for {self.wait_s:.0f} s (by {holder!r})")
                    time.sleep(_POLL_S)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                raise LockUnavailable(f"the alias lock in Redis at {redact_url(self.redis_url)}: {exc}") from None
            try:
                yield
            finally:
                with contextlib.suppress(redis.RedisError):
                    client.eval(_RELEASE, 1, key, token)
        finally:
            client.close()
