"""The trainer's consumer group on a real redis-server: read, ack, reclaim, corrupt entries."""

from __future__ import annotations

import time

import pytest
import redis

from trainer.intake.stream import CorrectionStream

pytestmark = pytest.mark.redis

STREAM = "test:corrections"


def append(client: redis.Redis, records) -> list[str]:
    return [client.xadd(STREAM, {"r": record.encode()}).decode() for record in records]


def test_group_reads_each_entry_once_and_ack_clears_pending(redis_client, make_record):
    stream = CorrectionStream(redis_client, stream=STREAM, consumer="a")
    assert stream.ensure_group() is True
    assert stream.ensure_group() is False  # BUSYGROUP tolerated
    records = [make_record(seed) for seed in range(10)]
    ids = append(redis_client, records)

    first = stream.read(count=6, block_ms=100)
    second = stream.read(count=6, block_ms=100)
    assert [entry_id for entry_id, _ in first + second] == ids
    assert [record for _, record in first + second] == records
    assert stream.read(count=6, block_ms=50) == []
    assert stream.pending_count() == 10

    assert stream.ack(entry_id for entry_id, _ in first) == 6
    assert stream.pending_count() == 4
    assert stream.ack([entry_id for entry_id, _ in second]) == 4
    assert stream.ack([]) == 0
    assert stream.pending_count() == 0


def test_group_created_on_an_existing_stream_reads_from_the_start(redis_client, make_record):
    ids = append(redis_client, [make_record(0), make_record(1)])  # written before any trainer ran
    stream = CorrectionStream(redis_client, stream=STREAM, consumer="a")
    stream.ensure_group()
    assert [entry_id for entry_id, _ in stream.read(count=10, block_ms=100)] == ids


def test_reclaim_takes_over_a_dead_consumers_entries(redis_url, redis_client, make_record):
    """Consumer A reads and dies without acknowledging; B claims the entries once they are idle."""
    crashed = CorrectionStream(redis_url, stream=STREAM, consumer="a")
    survivor = CorrectionStream(redis_url, stream=STREAM, consumer="b")
    crashed.ensure_group()
    records = [make_record(seed) for seed in range(5)]
    ids = append(redis_client, records)
    assert len(crashed.read(count=10, block_ms=100)) == 5  # ... and then A is killed

    assert survivor.read(count=10, block_ms=50) == []  # nothing new: all five are pending on A
    assert survivor.reclaim(min_idle_ms=60_000) == []  # not idle long enough yet
    time.sleep(0.15)
    claimed = survivor.reclaim(min_idle_ms=100, count=10)
    assert [entry_id for entry_id, _ in claimed] == ids
    assert [record for _, record in claimed] == records
    owners = redis_client.xpending_range(STREAM, "adaptive-spec-trainer", "-", "+", 10)
    assert {owner["consumer"] for owner in owners} == {b"b"}

    survivor.ack(entry_id for entry_id, _ in claimed)
    assert survivor.pending_count() == 0
    assert survivor.reclaim(min_idle_ms=0) == []


def test_reclaim_counts_entries_trimmed_while_pending(redis_client, make_record):
    stream = CorrectionStream(redis_client, stream=STREAM, consumer="a")
    stream.ensure_group()
    ids = append(redis_client, [make_record(seed) for seed in range(3)])
    stream.read(count=10, block_ms=100)
    redis_client.xdel(STREAM, ids[0])  # as MAXLEN ~ would, before anyone acknowledged it
    assert [entry_id for entry_id, _ in stream.reclaim(min_idle_ms=0)] == ids[1:]
    assert stream.trimmed == 1


def test_corrupt_entries_are_acked_counted_and_skipped(redis_client, make_record, caplog):
    stream = CorrectionStream(redis_client, stream=STREAM, consumer="a")
    stream.ensure_group()
    good = make_record(0)
    truncated = make_record(1).encode()[:-10]
    redis_client.xadd(STREAM, {"r": b"not a record"})
    redis_client.xadd(STREAM, {"r": truncated})
    redis_client.xadd(STREAM, {"other": b"field"})
    (good_id,) = append(redis_client, [good])

    batch = stream.read(count=10, block_ms=100)
    assert batch == [(good_id, good)]
    assert stream.corrupt == 3
    assert stream.pending_count() == 1  # only the good one waits for the trainer's ack
    assert sum("does not decode" in message for message in caplog.messages) == 3


def test_group_lost_with_redis_is_recreated(redis_client, make_record):
    stream = CorrectionStream(redis_client, stream=STREAM, consumer="a")
    stream.ensure_group()
    redis_client.flushdb()  # a Redis restart without persistence
    assert stream.pending_count() == 0
    assert stream.read(count=10, block_ms=50) == []
    ids = append(redis_client, [make_record(0)])
    assert [entry_id for entry_id, _ in stream.read(count=10, block_ms=100)] == ids


def test_refuses_a_client_that_decodes_responses(redis_url):
    with pytest.raises(ValueError, match="decode_responses"):
        CorrectionStream(redis.Redis.from_url(redis_url, decode_responses=True), stream=STREAM)
