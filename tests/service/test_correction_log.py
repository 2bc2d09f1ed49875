"""The correction-log writer against a real redis-server, including one that is down or stalled."""

from __future__ import annotations

import time

import pytest
import redis

from adaptive_spec.contracts import PAYLOAD_FIELD
from adaptive_spec.formats.record import CorrectionRecord
from service.correction_log import CorrectionLogWriter

pytestmark = pytest.mark.redis

STREAM = "test:corrections"


def assert_accounted(writer: CorrectionLogWriter, submitted: int) -> dict[str, int]:
    """The writer's invariant: every submitted record is written, dropped or still queued."""
    counts = writer.counters()
    assert counts["submitted"] == submitted
    assert counts["written"] + counts["dropped"] + counts["queue_depth"] == submitted, counts
    return counts


def test_records_reach_the_stream_intact(redis_url, redis_client, make_record):
    writer = CorrectionLogWriter(redis_url, stream=STREAM)
    records = [make_record(seed) for seed in range(20)]
    try:
        assert all(writer.submit(record) for record in records)
        assert writer.flush(timeout=5)
    finally:
        writer.close()
    assert assert_accounted(writer, 20)["written"] == 20
    entries = redis_client.xrange(STREAM)
    assert [CorrectionRecord.decode(fields[PAYLOAD_FIELD.encode()]) for _, fields in entries] == records


def test_maxlen_caps_the_stream(redis_url, redis_client, make_record):
    maxlen = 200
    writer = CorrectionLogWriter(redis_url, stream=STREAM, maxlen=maxlen, queue_size=5000)
    record = make_record(0, n_out=4, m=2)
    try:
        for _ in range(3000):
            writer.submit(record)
        assert writer.flush(timeout=10)
    finally:
        writer.close()
    assert assert_accounted(writer, 3000)["written"] == 3000
    length = redis_client.xlen(STREAM)
    print(f"\nstream length after 3000 writes with MAXLEN ~ {maxlen}: {length}")
    # MAXLEN ~ trims whole radix-tree nodes (stream-node-max-entries = 100), never below maxlen.
    assert maxlen <= length <= maxlen + 100


def test_a_byte_budget_caps_the_stream_whatever_the_count_allows(redis_url, redis_client, make_record):
    """Issue 30, item 6: records of about 4.7 kB each (64 tokens, m = 16) under a 1 MB budget and a count cap
    of 100,000: the stream holds about 1 MB (plus at most one trimmed node of 100 entries), not all 1,000."""
    budget = 1_000_000
    writer = CorrectionLogWriter(redis_url, stream=STREAM, maxlen=100_000, queue_size=5000, max_bytes=budget)
    records = [make_record(i, n_out=64, m=16) for i in range(8)]
    size = max(len(record.encode()) for record in records)
    try:
        for i in range(1000):
            writer.submit(records[i % len(records)])
        assert writer.flush(timeout=20)
    finally:
        writer.close()
    held = sum(len(fields[PAYLOAD_FIELD.encode()]) for _, fields in redis_client.xrange(STREAM))
    length = redis_client.xlen(STREAM)
    print(f"\n1000 records of ~{size} B under a {budget} B budget: {length} entries, {held} B of payload")
    assert 4 < size / 1000 < 6 and assert_accounted(writer, 1000)["written"] == 1000
    assert held <= budget + 100 * size and length < 1000  # before the budget: all 1000, 4.7 MB


def test_invalid_record_is_dropped_not_raised(redis_url, redis_client, make_record):
    writer = CorrectionLogWriter(redis_url, stream=STREAM)
    broken = make_record(1)
    broken.accepted.pop()
    try:
        assert writer.submit(broken) is False
        assert writer.submit(None) is False  # type: ignore[arg-type]
        assert writer.submit(make_record(2)) is True
        assert writer.flush(timeout=5)
    finally:
        writer.close()
    counts = assert_accounted(writer, 3)
    assert (counts["written"], counts["dropped"], counts["invalid"]) == (1, 2, 2)


def test_redis_down_then_back(redis_server, make_record):
    """Serving never waits: with Redis stopped, submit() returns at once and overflow is counted.
    After a restart on the same port the writer catches up by itself."""
    writer = CorrectionLogWriter(redis_server.url, stream=STREAM, queue_size=20, max_backoff_s=0.2)
    record = make_record(0)
    try:
        assert writer.submit(record) and writer.flush(timeout=5)
        redis_server.stop()

        for _ in range(60):
            started = time.perf_counter()
            writer.submit(record)
            assert time.perf_counter() - started < 0.05
        time.sleep(0.3)  # let the writer fail and back off a few times
        down = assert_accounted(writer, 61)
        assert down["written"] == 1 and down["queue_depth"] == 20 and down["dropped"] == 40
        assert down["errors"] >= 1

        redis_server.start()  # same port, empty: no persistence
        assert writer.flush(timeout=5), writer.counters()
        assert writer.submit(record) and writer.flush(timeout=5)
    finally:
        writer.close()
    after = assert_accounted(writer, 62)
    assert (after["written"], after["dropped"], after["queue_depth"]) == (22, 40, 0)
    assert redis.Redis.from_url(redis_server.url).xlen(STREAM) == 21  # 20 queued + 1 new


def test_stalled_redis_does_not_block_submit(redis_server, make_record):
    """A Redis that accepts connections but never answers (SIGSTOP) hits the socket timeout."""
    writer = CorrectionLogWriter(redis_server.url, stream=STREAM, queue_size=10, max_backoff_s=0.2)
    record = make_record(0)
    try:
        assert writer.submit(record) and writer.flush(timeout=5)  # the writer now holds a live connection
        redis_server.pause()
        slowest = 0.0
        for _ in range(30):
            started = time.perf_counter()
            writer.submit(record)
            slowest = max(slowest, time.perf_counter() - started)
            time.sleep(0.02)
        assert slowest < 0.05
        stalled = assert_accounted(writer, 31)
        assert stalled["written"] == 1 and stalled["dropped"] == 20 and stalled["queue_depth"] == 10

        redis_server.resume()
        assert writer.flush(timeout=5), writer.counters()
    finally:
        writer.close()
    counts = assert_accounted(writer, 31)
    assert (counts["written"], counts["dropped"], counts["queue_depth"]) == (11, 20, 0)
    length = redis.Redis.from_url(redis_server.url).xlen(STREAM)
    print(
        f"\nstalled Redis: {counts}; stream length {length}, the excess being batches that timed out but were applied"
    )
    assert length >= counts["written"]  # at-least-once: never fewer, possibly duplicates


def test_close_gives_up_on_a_dead_redis_in_time(redis_server, make_record):
    writer = CorrectionLogWriter(redis_server.url, stream=STREAM, max_backoff_s=0.2)
    redis_server.stop()
    for seed in range(5):
        writer.submit(make_record(seed))
    started = time.perf_counter()
    writer.close(timeout=0.5)
    assert time.perf_counter() - started < 2.0
    counts = assert_accounted(writer, 5)
    assert (counts["written"], counts["dropped"], counts["queue_depth"]) == (0, 5, 0)
    assert writer.submit(make_record(6)) is False  # closed
    assert_accounted(writer, 6)


def test_refused_writes_stay_queued_until_redis_accepts_them(redis_url, redis_client, make_record):
    """A command error (here WRONGTYPE; in production e.g. OOM) is retried like an outage, never lost."""
    redis_client.set(STREAM, "not a stream")
    writer = CorrectionLogWriter(redis_url, stream=STREAM, max_backoff_s=0.1)
    try:
        for seed in range(3):
            writer.submit(make_record(seed))
        time.sleep(0.3)
        refused = assert_accounted(writer, 3)
        assert refused["written"] == 0 and refused["queue_depth"] == 3 and refused["errors"] >= 1
        redis_client.delete(STREAM)
        assert writer.flush(timeout=5)
    finally:
        writer.close()
    assert assert_accounted(writer, 3)["written"] == 3
    assert redis_client.xlen(STREAM) == 3
