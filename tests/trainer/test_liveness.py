"""A hung trainer gives its lease up, and a silent Redis does not hang it (trainer/process/leader.py `follow`,
trainer/intake/stream.py `stream_client`).

Run: .venv/bin/python -m pytest tests/trainer/test_liveness.py -q   (tiny random Llama, real redis-servers, ~40 s)

Before: the lease renewed from its own thread whatever the main loop did, so a trainer stuck in a call
that never returned kept it forever and its standby never took over; and the stream's client had no
socket timeout of its own (redis-py's default for `from_url` is none in some versions, 5 s in others).
What must hold:

- the lease is renewed while the main loop makes progress, lapses once it has made none for `stall_s`
  (the standby takes over), and a leader whose loop comes back finds it taken and stops;
- the same with a real `OnlineTrainer` whose round hangs in a step: `progressed_at` stops, the standby
  leads, and once the step returns the old leader's run() stops;
- the trainer's stream client has socket timeouts, and run() comes back by its budget while Redis is
  stopped (SIGSTOP), then reads again once it continues.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
import redis
from polling import wait_for
from tiny import llama
from traffic import greedy_records

from adaptive_spec.contracts import PAYLOAD_FIELD, TRAINER_LEADER_KEY
from adaptive_spec.drafters.early_exit import build_early_exit
from trainer.evaluation.gate import Gate
from trainer.intake.stream import SOCKET_TIMEOUT_S, CorrectionStream, stream_client
from trainer.learning.distill import LoraSettings
from trainer.loop.online import OnlineSettings, OnlineTrainer
from trainer.process.leader import TrainerLease

pytestmark = [pytest.mark.redis, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def target():
    return llama(0, vocab=64)


@pytest.fixture(scope="module")
def records(target):
    return greedy_records(target, 48, domains=(None,))


def make_trainer(target, stream: CorrectionStream, root: Path) -> OnlineTrainer:
    settings = OnlineSettings(
        root / "adapters",
        checkpoint_dir=root / "checkpoint",
        target_id="tiny-llama",
        draft_id="early-exit:1",
        lora=LoraSettings(batch_tokens=256),
        gate=Gate(min_positions=100),
        holdout_fraction=0.25,
        min_new_records=8,
        round_steps=5,
        max_round_steps=5,
        max_domains=0,
    )
    return OnlineTrainer(build_early_exit(target, 1), stream, settings)


def write(client: redis.Redis, stream: str, records) -> None:
    pipe = client.pipeline()
    for record in records:
        pipe.xadd(stream, {PAYLOAD_FIELD: record.encode()})
    pipe.execute()


def standby_in_background(lease: TrainerLease, stop: threading.Event) -> tuple[threading.Thread, dict]:
    """`lease.acquire(stop)` in a thread; the dict gets "at" (time.monotonic()) once it leads."""
    led: dict = {}
    thread = threading.Thread(target=lambda: lease.acquire(stop) and led.update(at=time.monotonic()))
    thread.start()
    return thread, led


def test_the_lease_is_renewed_only_while_the_main_loop_makes_progress(redis_client, redis_url, caplog):
    leader = TrainerLease(redis_url, "leader@h:1", ttl_s=1.0)
    assert leader.acquire(threading.Event())
    lost = threading.Event()
    progressed = [time.monotonic()]
    leader.keep(on_lost=lost.set).follow(lambda: progressed[0], stall_s=2.0)
    stop = threading.Event()
    standby = TrainerLease(redis_url, "standby@h:2", ttl_s=1.0)
    thread, led = standby_in_background(standby, stop)
    try:
        beating_until = time.monotonic() + 4.0  # four ttls, twice stall_s: renewed throughout
        while time.monotonic() < beating_until:
            progressed[0] = time.monotonic()
            time.sleep(0.2)
        assert not led and redis_client.get(TRAINER_LEADER_KEY) == b"leader@h:1"

        hung_at = time.monotonic()  # the main loop stops making progress
        wait_for(lambda: led, 10, "the standby to take the lease over")
        took_s = led["at"] - hung_at
        assert leader.stalled and 2.0 <= took_s <= 2.0 + 1.0 + 2.0  # stall_s, then the ttl, then a poll at most
        assert redis_client.get(TRAINER_LEADER_KEY) == b"standby@h:2"

        progressed[0] = time.monotonic()  # the hung loop comes back: it finds the lease taken and stops
        wait_for(lost.is_set, 5, "the old leader to learn it lost the lease")
        assert leader.lost_to == "standby@h:2"
    finally:
        stop.set()
        thread.join(5)
        leader.release()
        standby.release()
    print(f"\nmain loop hung: the standby led {took_s:.1f} s later (stall_s 2 s, ttl 1 s)")
    assert any("no progress for" in r.getMessage() for r in caplog.records)


def test_a_trainer_hung_in_a_round_loses_its_lease_to_the_standby(target, records, redis_client, redis_url, tmp_path):
    stream_name = "test:liveness:hung"
    write(redis_client, stream_name, records)
    trainer = make_trainer(target, CorrectionStream(redis_url, stream=stream_name, consumer="leader"), tmp_path)
    hang, hung = threading.Event(), threading.Event()
    train_step = trainer.trainer.train_step

    def step_that_hangs(batch):
        hung.set()
        hang.wait()  # a call that does not return (until the test lets it)
        return train_step(batch)

    trainer.trainer.train_step = step_that_hangs
    stop = threading.Event()
    leader = TrainerLease(redis_url, "leader@h:1", ttl_s=1.0)
    assert leader.acquire(stop)
    leader.keep(on_lost=stop.set).follow(lambda: trainer.progressed_at, stall_s=2.0)  # as run_trainer wires it
    worker = threading.Thread(target=trainer.run, args=(stop,), kwargs=dict(checkpoint_every_s=60, poll_block_ms=50))
    standby_stop = threading.Event()
    standby = TrainerLease(redis_url, "standby@h:2", ttl_s=1.0)
    worker.start()
    thread, led = standby_in_background(standby, standby_stop)
    try:
        wait_for(hung.is_set, 60, "the round's first step")
        wait_for(lambda: led, 15, "the standby to lead while the leader's round hangs")
        assert worker.is_alive() and not stop.is_set()  # still hung: only the lease moved
        hang.set()  # the step returns; the loop's next progress finds the lease taken
        worker.join(60)
        assert not worker.is_alive() and stop.is_set() and leader.lost_to == "standby@h:2"
    finally:
        hang.set(), stop.set(), standby_stop.set()
        worker.join(60), thread.join(5)
        leader.release()
        standby.release()


def test_the_stream_client_times_out_and_run_rides_out_a_stopped_redis(target, records, redis_server, tmp_path):
    """SIGSTOP: Redis accepts nothing and answers nothing, the case a socket without a timeout waits out forever."""
    assert stream_client(redis_server.url).get_connection_kwargs()["socket_timeout"] == SOCKET_TIMEOUT_S
    stream = CorrectionStream(redis_server.url, stream="test:liveness:stopped", consumer="t")
    assert stream.redis.get_connection_kwargs()["socket_timeout"] == SOCKET_TIMEOUT_S
    client = redis.Redis.from_url(redis_server.url)
    write(client, "test:liveness:stopped", records[:10])
    trainer = make_trainer(target, stream, tmp_path)
    assert trainer.poll(block_ms=0) == 10
    redis_server.process.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        trainer.run(threading.Event(), budget_s=1.0, checkpoint_every_s=60, poll_block_ms=100)
        returned_s = time.monotonic() - started
    finally:
        redis_server.process.send_signal(signal.SIGCONT)
    print(f"\nRedis stopped: run(budget_s=1) came back after {returned_s:.1f} s")
    assert returned_s < 1.0 + 4 * SOCKET_TIMEOUT_S  # a read (and its retries) timed out; it never hung
    write(client, "test:liveness:stopped", records[10:20])
    wait_for(lambda: trainer.poll(block_ms=0) or trainer.records_consumed == 20, 20, "reads once Redis continues")
    assert trainer.records_consumed == 20
    client.close()
