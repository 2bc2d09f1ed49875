"""Bad correction records and failing rounds never stop the online trainer (trainer/intake/screening.py,
trainer/loop/online.py `_round_failed`).

Run: .venv/bin/python -m pytest tests/trainer/test_bad_records.py -q   (tiny random Llama, a real redis-server)

What an operator met: six records with token ids past the vocabulary (in the output, in the target's
top-m) and records of another target model, written into the stream of a running trainer. Its rounds
raised IndexError in the embedding, and every restart raised again on the same records, still pending
or in the checkpoint's buffer. What must hold:

- every kind of bad record, written into a real stream among good ones, is acknowledged at once,
  counted by reason (counters() and the status the dashboard shows) and never kept; `run()` goes on
  and trains its next round on the good records;
- a checkpoint that holds bad records (written before the screen) restores without them, counted;
- a round that raises for any other reason is logged with its traceback, the records it was reading
  are set aside (out of the buffers and out of the next checkpoint, their entries acknowledged), and
  `run()` trains the next round.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest
import redis
from polling import wait_for
from tiny import llama
from traffic import bad_records, greedy_records

from adaptive_spec.contracts import PAYLOAD_FIELD, TRAINER_STATUS_KEY
from adaptive_spec.drafters.early_exit import build_early_exit
from adaptive_spec.formats.record import CorrectionRecord
from trainer.evaluation.gate import Gate
from trainer.intake.stream import CorrectionStream
from trainer.learning.distill import LoraSettings
from trainer.loop.checkpoint import LATEST, read_records, write_records
from trainer.loop.online import OnlineSettings, OnlineTrainer

pytestmark = [pytest.mark.redis, pytest.mark.usefixtures("one_thread")]

VOCAB, TOP_M = 64, 8


@pytest.fixture(scope="module")
def target():
    return llama(0, vocab=VOCAB)


@pytest.fixture(scope="module")
def records(target) -> list[CorrectionRecord]:
    return greedy_records(target, 96, domains=(None,), top_m=TOP_M)


def make_trainer(target, client: redis.Redis, stream: str, root: Path) -> OnlineTrainer:
    settings = OnlineSettings(
        root / "adapters",
        checkpoint_dir=root / "checkpoint",
        target_id="tiny-llama",
        draft_id="early-exit:1",
        lora=LoraSettings(batch_tokens=256),
        gate=Gate(min_positions=100),
        holdout_fraction=0.25,
        min_new_records=16,
        round_steps=5,
        max_round_steps=5,
        read_count=16,
        max_domains=0,
    )
    return OnlineTrainer(build_early_exit(target, 1), CorrectionStream(client, stream=stream, consumer="t"), settings)


def kept_ids(trainer: OnlineTrainer) -> set[str]:
    return {record.request_id for record in trainer.holdout.records} | {e.request_id for e in trainer.buffer}


def checkpointed_ids(root: Path) -> set[str]:
    checkpoint = root / "checkpoint" / (root / "checkpoint" / LATEST).read_text()
    return {r.request_id for r in read_records(checkpoint / "buffer.bin") + read_records(checkpoint / "holdout.bin")}


def run_until(trainer: OnlineTrainer, condition, what: str, timeout: float = 120.0) -> dict:
    """run() in a thread until `condition()`, then stopped; returns its counters. A run() that raises fails here."""
    stop, outcome = threading.Event(), {}

    def loop() -> None:
        try:
            outcome["counters"] = trainer.run(stop, checkpoint_every_s=0.5, poll_block_ms=50)
        except BaseException as error:  # reported to the test below
            outcome["error"] = error

    worker = threading.Thread(target=loop, name="trainer-under-test")
    worker.start()
    try:
        wait_for(lambda: condition() or "error" in outcome, timeout, what)
    finally:
        stop.set()
        worker.join(60)
    assert "error" not in outcome, f"run() raised {outcome['error']!r}"
    return outcome["counters"]


def write(client: redis.Redis, stream: str, good: list[CorrectionRecord], bad: list[CorrectionRecord]) -> None:
    """The good records with one bad one every few, as they arrive from a fleet, in one pipeline."""
    pipe = client.pipeline()
    every = len(good) // max(1, len(bad))
    for index, record in enumerate(good):
        if index % every == 0 and index // every < len(bad):
            pipe.xadd(stream, {PAYLOAD_FIELD: bad[index // every].encode()})
        pipe.xadd(stream, {PAYLOAD_FIELD: record.encode()})
    pipe.execute()


def test_bad_records_of_every_kind_are_acknowledged_counted_and_dropped_and_training_goes_on(
    target, records, redis_client, tmp_path
):
    stream = "test:bad-records"
    made = bad_records(records[0], VOCAB)
    bad = [record for _, record in made.values()]
    trainer = make_trainer(target, redis_client, stream, tmp_path)
    write(redis_client, stream, records[:48], bad[:5])
    run_until(trainer, lambda: trainer.rounds >= 1, "a round trained past the first bad records")
    write(redis_client, stream, records[48:], bad[5:])
    redis_client.xadd(stream, {PAYLOAD_FIELD: b"not a correction record"})  # undecodable: the stream's own count
    counters = run_until(trainer, lambda: trainer.rounds >= 2, "the next round, past the other bad records")

    expected: dict[str, int] = {}
    for reason, _ in made.values():
        expected[reason] = expected.get(reason, 0) + 1
    print(f"\n{len(made)} bad records among {len(records)}: rejected {counters['rejected']}, {trainer.progress()}")
    assert counters["rejected"] == expected == {"vocab": 5, "model": 2, "top_m": 3}
    assert counters["corrupt"] == 1
    assert counters["rounds"] >= 2 and counters["rounds_failed"] == 0
    assert counters["records_consumed"] == len(records) and kept_ids(trainer) == {r.request_id for r in records}
    assert trainer.stream.pending_count() == 0  # the bad ones acknowledged at once, the good ones by a checkpoint
    assert not {record.request_id for record in bad} & checkpointed_ids(tmp_path)
    status = json.loads(redis_client.get(TRAINER_STATUS_KEY))  # what the dashboard shows
    assert status["rejected_records"] == len(made) and status["rejected_by_reason"] == expected


def test_bad_records_are_acknowledged_at_once_not_left_pending(target, records, redis_client, tmp_path):
    """Even before any checkpoint, a rejected entry is not pending: no restart or other consumer reads it again."""
    stream = "test:bad-records:ack"
    _, bad = bad_records(records[0], VOCAB)["output id past the vocabulary"]
    write(redis_client, stream, records[:5], [bad])
    trainer = make_trainer(target, redis_client, stream, tmp_path)
    assert trainer.poll(block_ms=0) == 6 and trainer.rejected == {"vocab": 1}
    assert trainer.stream.pending_count() == 5  # the good ones wait for a checkpoint; the bad one is done
    restarted = make_trainer(target, redis_client, stream, tmp_path)  # killed before any checkpoint
    assert restarted.poll(block_ms=0) == 5 and restarted.rejected == {}


def test_a_checkpoint_holding_bad_records_restores_without_them(target, records, redis_client, tmp_path):
    """A trainer from before the screen kept bad records in its checkpoint, and each restart raised on them."""
    stream = "test:bad-records:resume"
    write(redis_client, stream, records[:48], [])
    first = make_trainer(target, redis_client, stream, tmp_path)
    while first.poll(block_ms=0):
        pass
    path = first.checkpoint()
    made = bad_records(records[0], VOCAB)
    old_buffer = [r.encode() for r in read_records(path / "buffer.bin")]
    write_records(path / "buffer.bin", old_buffer + [record.encode() for _, record in made.values()])
    state = json.loads((path / "state.json").read_text())
    del state["counters"]["rejected"]  # as a trainer from before the screen wrote it
    (path / "state.json").write_text(json.dumps(state))

    resumed = make_trainer(target, redis_client, stream, tmp_path)
    assert sum(resumed.rejected.values()) == len(made) and kept_ids(resumed) == kept_ids(first)
    result = resumed.train_round()
    assert result.trained, result.reason
    resumed.checkpoint()
    assert checkpointed_ids(tmp_path) == kept_ids(first)
    again = make_trainer(target, redis_client, stream, tmp_path)
    assert again.rejected == resumed.rejected  # counted once, kept in the checkpoint's counters


def test_a_round_that_raises_is_logged_its_records_set_aside_and_training_goes_on(
    target, records, redis_client, tmp_path, caplog
):
    """A fault no screen knows (here a step that raises once, as a record nobody foresaw would): logged
    with its traceback, the batch it was training on set aside, and the next round trains."""
    stream = "test:bad-records:round"
    write(redis_client, stream, records[:48], [])
    trainer = make_trainer(target, redis_client, stream, tmp_path)
    train_step, failing = trainer.trainer.train_step, {}

    def fails_once(batch):
        if not failing:
            failing.update((example.request_id, example) for example in batch)
            raise RuntimeError("injected: a step that raises")
        return train_step(batch)

    trainer.trainer.train_step = fails_once
    with caplog.at_level(logging.ERROR, logger="trainer.loop.online"):
        run_until(trainer, lambda: trainer.rounds_failed == 1, "the failed round")
    failed = [r for r in caplog.records if "failed (RuntimeError: injected" in r.getMessage()]
    assert failed and failed[0].exc_info is not None  # logged with its traceback
    assert trainer.records_set_aside == len(failing) > 0
    assert not set(failing) & kept_ids(trainer) and not set(failing) & checkpointed_ids(tmp_path)
    assert trainer.stream.pending_count() == 0  # their entries acknowledged by that checkpoint
    status = json.loads(redis_client.get(TRAINER_STATUS_KEY))
    assert "failed (RuntimeError: injected" in status["last_failure"]["message"]  # whatever it says since
    assert status["last_failure"]["rounds_failed"] == 1

    write(redis_client, stream, records[48:], [])
    counters = run_until(trainer, lambda: trainer.rounds >= 1, "a round after the failed one")
    assert counters["rounds"] >= 1 and counters["rounds_failed"] == 1
