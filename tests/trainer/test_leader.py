"""The trainer's lease on a real redis-server: one leader, a standby that says so and takes over when the
lease is released or expires, a leader that loses the lease promotes nothing more.

    .venv/bin/python -m pytest tests/trainer/test_leader.py -q     (about 5 s)

Two real `adaptive-spec train` processes on one stream: tests/reliability/test_fleet.py.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

import pytest

from adaptive_spec.contracts import TRAINER_LEADER_KEY
from trainer.process.leader import LeaseLost, TrainerLease, holder_id

pytestmark = pytest.mark.redis


def acquire_within(lease: TrainerLease, seconds: float) -> bool:
    stop = threading.Event()
    timer = threading.Timer(seconds, stop.set)
    timer.start()
    try:
        return lease.acquire(stop)
    finally:
        timer.cancel()


def test_one_leader_and_a_standby_that_says_so_and_takes_over_on_release(redis_client, redis_url, caplog):
    leader, standby = TrainerLease(redis_url, "a@h:1"), TrainerLease(redis_url, "b@h:2")
    assert acquire_within(leader, 1)
    assert redis_client.get(TRAINER_LEADER_KEY) == b"a@h:1"
    assert 9000 < redis_client.pttl(TRAINER_LEADER_KEY) <= 10000
    with caplog.at_level(logging.INFO, logger="trainer.process.leader"):
        assert not acquire_within(standby, 0.5)  # stopped while standby
    (line,) = [r.getMessage() for r in caplog.records if "standby" in r.getMessage()]
    assert line.startswith(f"standby: b@h:2 waits for the lease {TRAINER_LEADER_KEY}, held by a@h:1 (expires in")

    released = threading.Timer(0.3, leader.release)
    released.start()
    started = time.monotonic()
    assert acquire_within(standby, 5)
    assert time.monotonic() - started < 2.0  # polls every second at most
    assert redis_client.get(TRAINER_LEADER_KEY) == b"b@h:2"
    standby.release()
    assert redis_client.get(TRAINER_LEADER_KEY) is None


def test_a_lease_nobody_renews_expires_and_the_standby_takes_over(redis_client, redis_url):
    crashed = TrainerLease(redis_url, "a@h:1", ttl_s=1.0)
    assert acquire_within(crashed, 1)  # and never renewed: as if SIGKILLed
    standby = TrainerLease(redis_url, "b@h:2", ttl_s=1.0)
    started = time.monotonic()
    assert acquire_within(standby, 5)
    assert 0.5 < time.monotonic() - started < 2.5


def test_the_leader_renews_and_a_lost_lease_stops_promotions(redis_client, redis_url):
    leader = TrainerLease(redis_url, "a@h:1", ttl_s=1.0)
    assert acquire_within(leader, 1)
    lost = threading.Event()
    leader.keep(on_lost=lost.set)
    time.sleep(1.5)  # longer than the ttl: only renewals keep it
    assert redis_client.get(TRAINER_LEADER_KEY) == b"a@h:1"

    promoted = []
    promote = leader.fenced(promoted.append)
    promote("v1")
    redis_client.set(TRAINER_LEADER_KEY, "b@h:2")  # e.g. Redis restarted empty and the standby got there first
    assert lost.wait(2.0)
    with pytest.raises(LeaseLost, match=r"a@h:1 lost the lease .* to b@h:2"):
        promote("v2")
    assert promoted == ["v1"] and leader.lost_to == "b@h:2"
    leader.release()
    assert redis_client.get(TRAINER_LEADER_KEY) == b"b@h:2"  # never deletes another holder's lease


def test_a_lease_that_redis_forgot_is_set_again_by_its_leader(redis_client, redis_url):
    leader = TrainerLease(redis_url, "a@h:1")
    assert acquire_within(leader, 1)
    redis_client.delete(TRAINER_LEADER_KEY)  # Redis restarted without persistence
    leader.confirm()
    assert redis_client.get(TRAINER_LEADER_KEY) == b"a@h:1"
    leader.release()


def test_a_dead_process_of_this_host_leaves_a_lease_taken_over_at_once(redis_client, redis_url):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = holder_id("trainer-0").rsplit(":", 1)[0] + f":{gone.pid}"
    redis_client.set(TRAINER_LEADER_KEY, dead, px=60_000)
    restarted = TrainerLease(redis_url, holder_id("trainer-0"))
    started = time.monotonic()
    assert acquire_within(restarted, 2)
    assert time.monotonic() - started < 0.5
    restarted.release()

    alive = holder_id("trainer-0").rsplit(":", 1)[0] + ":1"  # pid 1 runs on every host
    redis_client.set(TRAINER_LEADER_KEY, alive, px=60_000)
    assert not acquire_within(TrainerLease(redis_url, holder_id("trainer-0")), 0.5)
    elsewhere = "trainer-0@another-host:12345"
    redis_client.set(TRAINER_LEADER_KEY, elsewhere, px=60_000)
    assert not acquire_within(TrainerLease(redis_url, holder_id("trainer-0")), 0.5)
