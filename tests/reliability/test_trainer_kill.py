"""`adaptive-spec train` SIGKILLed mid-batch, then restarted: no acknowledged record is lost, the entries it
held are read again, and training goes on from the checkpoint (DESIGN.md "Trainer killed mid-batch").

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/reliability/test_trainer_kill.py -q -s   (about 40 s)

The trainer is a real process on a tiny model directory, reading a private redis-server. Records
are random (vocabulary 112, top-8), so rounds train and the gate judges, though nothing needs to
be promoted. After the SIGKILL the process state is frozen, so "acknowledged" is read from Redis
exactly: every entry the group delivered (id <= last-delivered-id) that is not in the pending list.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import redis
from support import TrainProcess, eventually
from traffic import feed

from adaptive_spec.contracts import CORRECTION_STREAM, PAYLOAD_FIELD, TRAINER_GROUP
from adaptive_spec.formats.record import CorrectionRecord
from trainer.loop.checkpoint import LATEST, read_records

pytestmark = pytest.mark.redis

RECORDS = 240
ARGS = [
    "--consumer",
    "trainer-1",
    "--min-new-records",
    "8",
    "--round-steps",
    "60",
    "--gate-min-positions",
    "48",
    "--checkpoint-every-s",
    "1",
]


def acknowledged(client: redis.Redis) -> set[str]:
    """Request ids of the entries the group delivered and that were acknowledged since."""
    (group,) = [g for g in client.xinfo_groups(CORRECTION_STREAM) if g["name"] == TRAINER_GROUP.encode()]
    delivered = client.xrange(CORRECTION_STREAM, "-", group["last-delivered-id"])
    pending = {
        entry["message_id"] for entry in client.xpending_range(CORRECTION_STREAM, TRAINER_GROUP, "-", "+", 10_000)
    }
    return {
        CorrectionRecord.decode(fields[PAYLOAD_FIELD.encode()]).request_id
        for entry_id, fields in delivered
        if entry_id not in pending
    }


def checkpoint(data_dir: Path) -> tuple[set[str], dict] | None:
    """(request ids held by the latest checkpoint, its state.json), or None while there is none or it is
    being replaced (the trainer removes the previous directory right after naming the new one)."""
    root = data_dir / "trainer"
    try:
        directory = root / (root / LATEST).read_text().strip()
        records = read_records(directory / "buffer.bin") + read_records(directory / "holdout.bin")
        return {record.request_id for record in records}, json.loads((directory / "state.json").read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None


def test_sigkilled_trainer_loses_no_acknowledged_record_and_resumes(
    redis_server, tiny_model_dir, tmp_path, make_record
):
    client = redis.Redis.from_url(redis_server.url)
    records = [
        make_record(
            seed,
            n_out=24,
            m=8,
            vocab=112,
            request_id=f"req-{seed:04d}",
            target_id=str(tiny_model_dir),
            draft_id="early-exit:1",
        )  # the trainer's own: it drops any other model's records
        for seed in range(RECORDS)
    ]
    trainer = TrainProcess(tmp_path, tiny_model_dir, redis_server.url, ARGS, name="train-1")
    trainer.start()
    try:
        feed(client, records[:120])
        eventually(
            lambda: (state := checkpoint(trainer.data_dir)) and state[1]["counters"]["rounds"] >= 1,
            90,
            "a checkpoint after the first round",
        )
        feed(client, records[120:200])  # the next polls read these; a round trains on them
        eventually(
            lambda: client.xpending(CORRECTION_STREAM, TRAINER_GROUP)["pending"] > 0,
            30,
            "entries read and not yet acknowledged",
        )
        trainer.process.kill()  # SIGKILL: no handler, no last checkpoint
        assert trainer.wait(10) == -signal.SIGKILL
    finally:
        trainer.stop()

    held_at_kill, state_at_kill = checkpoint(trainer.data_dir)
    acked = acknowledged(client)
    pending_at_kill = client.xpending(CORRECTION_STREAM, TRAINER_GROUP)["pending"]
    print(
        f"\nSIGKILL: {len(acked)} acknowledged, {pending_at_kill} pending, checkpoint holds {len(held_at_kill)} "
        f"records after {state_at_kill['counters']['rounds']} rounds"
    )
    assert pending_at_kill > 0
    assert acked <= held_at_kill, f"acknowledged but not checkpointed: {sorted(acked - held_at_kill)[:5]}"

    feed(client, records[200:])
    restarted = TrainProcess(tmp_path, tiny_model_dir, redis_server.url, ARGS, name="train-2")
    restarted.start()
    try:
        everything = {record.request_id for record in records}
        eventually(
            lambda: (
                (state := checkpoint(trainer.data_dir))
                and state[0] == everything
                and client.xpending(CORRECTION_STREAM, TRAINER_GROUP)["pending"] == 0
            ),
            90,
            "every record checkpointed and acknowledged by the restarted trainer",
        )
        restarted.signal(signal.SIGTERM)
        assert restarted.wait(60) == 0, restarted.log()[-3000:]
    finally:
        restarted.stop()

    held, state = checkpoint(trainer.data_dir)
    log = restarted.log()
    print(
        f"restart: {len(held)} records held, {state['counters']['records_consumed']} consumed, "
        f"{state['counters']['duplicates']} duplicates, rounds {state_at_kill['counters']['rounds']} -> "
        f"{state['counters']['rounds']}"
    )
    assert held == everything and acknowledged(client) == everything
    assert state["counters"]["records_consumed"] == RECORDS
    assert state["counters"]["rounds"] > state_at_kill["counters"]["rounds"]  # counters carried over, then grew
    assert f"resumed from {trainer.data_dir / 'trainer'}" in log
    assert f"re-reading {pending_at_kill} entries that consumer trainer-1 read before" in log
    client.close()
