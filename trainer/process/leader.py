"""One trainer per correction stream: a lease in Redis says which `adaptive-spec train` may train and promote.

    lease = TrainerLease(redis_url, holder_id("trainer-0"), ttl_s=10.0)
    if lease.acquire(stop):             # standby until the lease is free (logged), False if stopped first
        lease.keep(on_lost=stop.set)    # a thread renews it every ttl/4 while training
        lease.follow(lambda: trainer.progressed_at, stall_s=300.0)   # ... while the main loop makes progress
        ...                             # train; before each promotion: lease.confirm()
        lease.release()                 # at exit: the standby takes over at once

Why: two trainers started by mistake on the same stream would split its records between them
(one consumer group) and each would promote what it trained, so the champion would flip between
two lineages. With the lease, the second one waits and says so:

    standby: trainer-0@host-b:812 waits for the lease adaptive_spec:trainer_leader, held by
    trainer-0@host-a:655 (expires in 9.6 s); it takes over when that trainer stops renewing it

The lease is the key `adaptive_spec:trainer_leader` (contracts.TRAINER_LEADER_KEY), set with
`SET key <holder> NX PX <ttl>` and renewed every ttl/4 by a compare-and-PEXPIRE script, so only
its holder can extend or delete it. Worked example with the default ttl of 10 s: the leader is
SIGKILLed at t = 0, its last renewal was at t = -2.5 s at the latest, so the key expires by
t = 7.5 s and the standby, polling every second, takes over by t = 8.5 s; it then reads the stream
as the same consumer group (the dead leader's unacknowledged entries come back through XAUTOCLAIM,
or at once when it uses the same consumer name) and follows the registry's champion. A leader
stopped with SIGTERM deletes the key, so its standby takes over within a second.

Holders are `<consumer>@<hostname>:<pid>`, unique per process. A restarted trainer that finds the
key held by a process of its own host that no longer exists (the same consumer name, a dead pid)
takes it over at once instead of waiting out the ttl: that holder cannot renew any more.

A hung leader: the renewal thread is not the trainer. Once `follow` names when the trainer's main loop
last made progress (`OnlineTrainer.progressed_at`: each poll of the stream and each optimiser step),
the thread renews only while that was within `stall_s`. A main loop stuck for longer (a call that never
returns) lets the lease lapse, logged, and the standby takes over; should the loop come back, it finds
the lease taken at its next renewal and stops as below. `stall_s` must exceed the longest step of the
loop that makes no progress mark: scoring a held-out set (up to 256 records; about 100 s for a head on
the default model, when every record's target states are new) or a registry call while MLflow hangs
(10 s a try, 3 tries).

Losing the lease: the renewal thread finds another holder in the key (say Redis restarted empty
and the standby got there first). It calls `on_lost`; the trainer stops like on SIGTERM, promotes
nothing more (`confirm()` before each promotion says no), and exits with an error, so its
supervisor restarts it as a standby. While Redis does not answer, the leader keeps the lease it
had (the standby cannot take it either) and re-sets the key when Redis comes back empty.

Tests: `OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/trainer/test_leader.py tests/reliability/test_fleet.py -q -s`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import redis

from adaptive_spec.contracts import TRAINER_LEADER_KEY

log = logging.getLogger(__name__)

# KEYS[1] the lease, ARGV[1] this holder, ARGV[2] ttl in ms: 1 = ours (extended, or set again after
# Redis lost it), 0 = another holder has it.
_RENEW = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if not holder then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1 end
return 0
"""
# KEYS[1] the lease, ARGV[1] the holder expected, ARGV[2] the new holder, ARGV[3] ttl in ms.
_REPLACE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) and 1 end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def holder_id(consumer: str) -> str:
    """`trainer-0` in process 655 on host-a -> "trainer-0@host-a:655"."""
    return f"{consumer}@{socket.gethostname()}:{os.getpid()}"


class LeaseLost(RuntimeError):
    """Another trainer holds the lease this one had."""


class TrainerLease:
    def __init__(self, redis_url: str, holder: str, ttl_s: float = 10.0, key: str = TRAINER_LEADER_KEY) -> None:
        if ttl_s < 1.0:
            raise ValueError(f"the lease ttl must be at least 1 s, got {ttl_s}")
        self.holder = holder
        self.key = key
        self.ttl_ms = int(ttl_s * 1000)
        self.poll_s = min(1.0, ttl_s / 4)
        self.lost_to: str | None = None  # the holder that took the lease from us, once lost
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self._renew = self._redis.register_script(_RENEW)
        self._replace = self._redis.register_script(_REPLACE)
        self._release = self._redis.register_script(_RELEASE)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._progressed_at: Callable[[], float] | None = None  # `follow`: the main loop's last progress
        self.stall_s = 0.0
        self.stalled = False  # the main loop made no progress for stall_s: the lease is left to lapse

    # ---------------------------------------------------------------- standby, then leader

    def acquire(self, stop: threading.Event) -> bool:
        """Wait until this process holds the lease (True), or until `stop` is set (False)."""
        waited_since, announced = time.monotonic(), None
        while not stop.is_set():
            try:
                holder = self._try_acquire()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if announced != "redis":
                    log.warning("standby: cannot reach Redis for the lease %s (%s); retrying", self.key, exc)
                    announced = "redis"
                stop.wait(self.poll_s)
                continue
            if holder is None:
                waited = f" after {time.monotonic() - waited_since:.1f} s standby" if announced else ""
                log.info("leader: %s holds the lease %s%s", self.holder, self.key, waited)
                return True
            if announced != holder:
                log.warning(
                    "standby: %s waits for the lease %s, held by %s (expires in %.1f s); it takes over when that "
                    "trainer stops renewing it",
                    self.holder,
                    self.key,
                    holder,
                    max(0, self._redis.pttl(self.key)) / 1000,
                )
                announced = holder
            stop.wait(self.poll_s)
        return False

    def keep(self, on_lost: Callable[[], None]) -> TrainerLease:
        """Renew the lease from a thread every ttl/4; call `on_lost` once if another holder takes it."""

        def renew_loop() -> None:
            while not self._stop.wait(self.ttl_ms / 4000):
                if self._main_loop_stalled():
                    continue
                try:
                    self.confirm()
                except LeaseLost:
                    on_lost()
                    return
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    log.warning("could not renew the lease %s (%s); retrying", self.key, exc)

        self._thread = threading.Thread(target=renew_loop, name="trainer-lease", daemon=True)
        self._thread.start()
        return self

    def follow(self, progressed_at: Callable[[], float], stall_s: float) -> TrainerLease:
        """From now on, renew only while `progressed_at()` (a time.monotonic() value: when the main loop
        last made progress) is at most `stall_s` old."""
        if stall_s * 1000 < self.ttl_ms:
            raise ValueError(f"stall_s ({stall_s}) must be at least the lease's ttl ({self.ttl_ms / 1000} s)")
        self.stall_s, self._progressed_at = stall_s, progressed_at
        return self

    def _main_loop_stalled(self) -> bool:
        """True (logged once per stall) while the main loop has made no progress for `stall_s`."""
        if self._progressed_at is None:
            return False
        idle_s = time.monotonic() - self._progressed_at()
        if (idle_s > self.stall_s) != self.stalled:
            self.stalled = not self.stalled
            if self.stalled:
                log.error(
                    "the trainer's main loop has made no progress for %.0f s: no longer renewing the lease %s, "
                    "so a standby takes over within %.0f s",
                    idle_s,
                    self.key,
                    self.ttl_ms / 1000,
                )
            else:
                log.warning(
                    "the trainer's main loop made progress again; renewing the lease %s if still ours", self.key
                )
        return self.stalled

    def confirm(self) -> None:
        """Extend the lease now; raises LeaseLost if another trainer holds it (and redis errors as they come)."""
        if self.lost_to is None and self._renew(keys=[self.key], args=[self.holder, self.ttl_ms]) == 1:
            return
        if self.lost_to is None:
            self.lost_to = (self._redis.get(self.key) or b"nobody").decode()
            log.error("lost the lease %s to %s: this trainer promotes nothing more and stops", self.key, self.lost_to)
        raise LeaseLost(f"{self.holder} lost the lease {self.key} to {self.lost_to}")

    def fenced(self, promote: Callable[[object], None]) -> Callable[[object], None]:
        """`promote(adapter)` guarded by the lease: LeaseLost instead when another trainer holds it.

        While Redis does not answer, the promotion goes ahead. A trainer on the other side of a network
        split could take the lease meanwhile; the registration queue still promotes a version only
        over the champion it was trained from (trainer/promotion/pending.py), so the two cannot alternate.
        """

        def call(adapter) -> None:
            try:
                self.confirm()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("could not confirm the lease %s before promoting (%s); promoting", self.key, exc)
            promote(adapter)

        return call

    def release(self) -> None:
        """Stop renewing and delete the key if it is still ours, so a standby takes over at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        try:
            if self._release(keys=[self.key], args=[self.holder]):
                log.info("released the lease %s", self.key)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("could not release the lease %s (%s); it expires in %.0f s", self.key, exc, self.ttl_ms / 1000)
        finally:
            self._redis.close()

    # ---------------------------------------------------------------- one attempt

    def _try_acquire(self) -> str | None:
        """Take the lease if free, ours, or left by a dead process of this host (None); else return its holder."""
        if self._redis.set(self.key, self.holder, nx=True, px=self.ttl_ms):
            return None
        holder = (self._redis.get(self.key) or b"").decode()
        if not holder:  # it expired between the SET and the GET
            return None if self._redis.set(self.key, self.holder, nx=True, px=self.ttl_ms) else "another trainer"
        if (holder == self.holder or _dead_here(holder)) and self._replace(
            keys=[self.key], args=[holder, self.holder, self.ttl_ms]
        ) == 1:
            if holder != self.holder:
                log.info("took the lease %s over from %s, a process of this host that is gone", self.key, holder)
            return None
        return holder


def _dead_here(holder: str) -> bool:
    """True when `holder` ("name@host:pid") names this host and a pid that is not running here."""
    _, _, where = holder.rpartition("@")
    host, _, pid = where.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, someone else's
        return False
    return False
