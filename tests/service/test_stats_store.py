"""The dashboard store (service/stats_store.py, its reads in service/stats_queries.py and
service/drift.py) against a real redis-server: bucket sums across replicas, resolution by range,
retention, Redis outages, markers and the drift alert.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/service/test_stats_store.py -q
"""

from __future__ import annotations

import time

import pytest
import redis

from adaptive_spec.contracts import STATS_ADAPTERS_KEY, STATS_EVENTS_KEY
from adaptive_spec.contracts import stats_bucket_key as bucket_key
from adaptive_spec.formats.adapter_metadata import AdapterMetadata
from adaptive_spec.formats.stats import RequestStats, StepStats
from service.drift import DriftSettings
from service.stats_queries import FINE_RETENTION_CAP_S, field_name
from service.stats_store import MAX_PENDING_KEYS, StatsRecorder

pytestmark = pytest.mark.redis

T0 = int(time.time() // 600 * 600) - 3600  # recent (within every retention), and a multiple of 600


def request_stats(
    steps: list[tuple[int, int]], version: str | None = None, wall_s: float = 1.0, prefill_s: float = 0.2
) -> RequestStats:
    """A request of decoding steps (drafted, accepted); each emits accepted + 1 tokens."""
    stats = RequestStats(adapter_version=version, wall_s=wall_s, prefill_s=prefill_s)
    for drafted, accepted in steps:
        stats.add(StepStats(drafted, accepted, accepted + 1, drafted, 0.01, 0.05))
    return stats


def recorder(redis_url: str, **kwargs) -> StatsRecorder:
    return StatsRecorder(redis_url, flush_every_s=3600, **kwargs)  # flushed by hand in these tests


def test_two_replicas_add_up_in_every_bucket_size(redis_client, redis_url):
    a, b = recorder(redis_url, replica="a"), recorder(redis_url, replica="b")
    first = request_stats([(4, 3), (4, 0), (4, 4)], "7", wall_s=1.5, prefill_s=0.5)  # 12 drafted, 7 accepted
    second = request_stats([(3, 1), (0, 0)], "7", wall_s=0.6, prefill_s=0.1)  # 3 drafted, 1 accepted
    a.record(first, domain="sql", greedy=True, ended_at=T0 + 3)
    b.record(second, domain="sql", greedy=False, ended_at=T0 + 7)
    b.record(request_stats([(2, 2)], "7"), domain="code", greedy=True, ended_at=T0 + 15)  # the next 10 s bucket
    assert a.flush() and b.flush()

    def field(resolution, name, domain="sql"):
        raw = redis_client.hget(bucket_key(resolution, T0), field_name("7", domain, name))
        return None if raw is None else float(raw)

    for resolution in (10, 60, 600):
        assert field(resolution, "requests") == 2
        assert field(resolution, "drafted") == 12 + 3
        assert field(resolution, "accepted") == 7 + 1
        assert field(resolution, "drafts") == 3 + 1  # steps that drafted: the (0, 0) step did not
        assert field(resolution, "accepted_first") == 2 + 1
        assert field(resolution, "drafts_greedy") == 3  # only the first request was greedy
        assert field(resolution, "tokens") == (4 + 1 + 5) + (2 + 1)
        assert field(resolution, "target_forwards") == 3 + 2
        assert field(resolution, "decode_s") == pytest.approx(1.0 + 0.5)
    assert field(10, "requests", "code") is None  # T0 + 15 is in the second 10 s bucket...
    assert field(60, "requests", "code") == 1  # ...and in the first minute


def test_the_bucket_under_way_is_read(redis_client, redis_url):
    """A range ending half a second into a bucket includes that bucket: cut at int(end), a reader in the
    first second of a 10 s bucket would lose the requests just recorded there."""
    stats = recorder(redis_url)
    stats.record(request_stats([(2, 1)], "3"), domain="sql", greedy=True, ended_at=T0 + 10.2)
    assert stats.flush()
    for end in (T0 + 10.5, T0 + 11, T0 + 19.9):
        series = stats.series(T0, end, step=10)
        assert series["t"][-1] == T0 + 10
        assert series["by_version"]["3"]["requests"][-1] == 1
        assert [b for b, _ in stats.read_buckets(T0, end, 10)] == [T0 + 10]
    assert "3" not in stats.series(T0, T0 + 10, step=10)["by_version"]  # [T0, T0 + 10) ends before it


def test_series_figures_follow_the_documented_formulas(redis_client, redis_url):
    stats = recorder(redis_url)
    stats.record(
        request_stats([(4, 3)] * 10, "4", wall_s=0.7, prefill_s=0.2), domain="json", greedy=True, ended_at=T0 + 1
    )
    stats.record(
        request_stats([(0, 0)] * 8, None, wall_s=0.5, prefill_s=0.1),
        domain=None,
        greedy=True,
        ended_at=T0 + 2,
        speculative=False,
    )  # the target alone, in the same bucket
    stats.flush()
    series = stats.series(T0, T0 + 60, step=10)
    assert series["t"] == [T0 + 10 * i for i in range(6)]
    v4 = series["by_version"]["4"]
    assert v4["acceptance_rate"][0] == pytest.approx(30 / 40)
    assert v4["mean_acceptance_length"][0] == pytest.approx(40 / 10)
    assert v4["first_token_acceptance"][0] == pytest.approx(1.0)
    assert v4["tokens_per_s"][0] == pytest.approx(40 / 0.5, rel=1e-3)
    assert v4["speedup"][0] == pytest.approx((40 / 0.5) / (8 / 0.4), rel=1e-3)
    assert v4["requests"] == [1, None, None, None, None, None]
    assert series["by_version"]["target"]["acceptance_rate"][0] is None  # nothing drafted
    assert set(series["by_domain"]) == {"json"}  # the target-alone baseline is not a domain's traffic


def test_speedup_is_null_without_target_alone_requests_in_the_bucket(redis_client, redis_url):
    stats = recorder(redis_url)
    stats.record(request_stats([(4, 3)] * 5, "4"), domain="a", greedy=True, ended_at=T0 + 1)
    stats.record(request_stats([(0, 0)] * 5, None), domain="a", greedy=True, ended_at=T0 + 25, speculative=False)
    stats.flush()
    series = stats.series(T0, T0 + 30, step=10)
    assert series["by_version"]["4"]["tokens_per_s"][0] is not None
    assert series["by_version"]["4"]["speedup"] == [None, None, None]  # the baseline is two buckets later
    assert stats.series(T0, T0 + 60, step=60)["by_version"]["4"]["speedup"][0] is not None  # same minute


@pytest.mark.parametrize(
    "span, resolution, step", [(3600, 10, 10), (6 * 3600, 10, 10), (86400, 60, 60), (7 * 86400, 600, 600)]
)
def test_resolution_fits_the_range(redis_url, span, resolution, step):
    stats = recorder(redis_url)
    now = time.time()
    assert stats.resolution_for(now - span, now) == (resolution, step)


def test_series_of_24_hours_reads_minute_buckets_with_every_request(redis_client, redis_url):
    stats = recorder(redis_url)
    start = T0 + 3600 - 86400  # the last 24 h: the series reads no bucket past now
    end = start + 86400
    for i in range(0, 86400, 97):  # one request every 97 s, all of it inside the range
        stats.record(request_stats([(3, 1)], "2"), domain="d", greedy=True, ended_at=start + i)
        if i % 97_00 == 0:
            stats.flush()  # as the background thread would: pending buckets are bounded
    stats.flush()
    assert stats.counts["dropped_keys"] == 0
    series = stats.series(start, end, step=60)
    assert series["resolution"] == 60 and len(series["t"]) == 1440
    assert sum(n or 0 for n in series["by_version"]["2"]["requests"]) == len(range(0, 86400, 97))


def test_buckets_expire_after_the_retention(redis_client, redis_url):
    stats = recorder(redis_url, retention_s=3 * 86400)
    stats.record(request_stats([(2, 1)], "1"), domain=None, greedy=True)
    stats.flush()
    ttls = {
        int(key.decode().split(":")[-2]): redis_client.ttl(key)
        for key in redis_client.scan_iter("adaptive_spec:stats:b:*")
    }
    assert set(ttls) == {10, 60, 600}
    assert FINE_RETENTION_CAP_S - 5 <= ttls[10] <= FINE_RETENTION_CAP_S  # 10 s buckets: capped at 2 days
    assert 3 * 86400 - 5 <= ttls[60] <= 3 * 86400 and 3 * 86400 - 5 <= ttls[600] <= 3 * 86400


def test_adapter_figures_expire_with_the_buckets_and_traffic_renews_them(redis_client, redis_url):
    """RELIABILITY.md: every key expires. The adapters' gate figures live as long as the buckets they
    explain: each flush renews the hash's expiry, so a version served for weeks keeps its figures."""
    stats = recorder(redis_url, retention_s=3 * 86400)
    stats.mark("swap", "3", metadata=gate_metadata(0.6, 0.4))
    stats.flush()
    assert 3 * 86400 - 5 <= redis_client.ttl(STATS_ADAPTERS_KEY) <= 3 * 86400
    redis_client.expire(STATS_ADAPTERS_KEY, 60)  # days later, no swap since
    stats.record(request_stats([(2, 1)], "3"), domain=None, greedy=True)
    stats.flush()
    assert 3 * 86400 - 5 <= redis_client.ttl(STATS_ADAPTERS_KEY) <= 3 * 86400
    assert stats.adapter_info("3")["gate"]["candidate"]["greedy_match"] == 0.6


def test_redis_down_never_raises_and_the_sums_arrive_when_it_returns(redis_server):
    stats = StatsRecorder(redis_server.url, flush_every_s=3600)
    redis_server.stop()
    started = time.perf_counter()
    for i in range(50):
        stats.record(request_stats([(3, 2)], "5"), domain="x", greedy=True, ended_at=T0 + i)
    stats.mark("rollback", "4", by="test")
    assert time.perf_counter() - started < 0.5  # memory only: no connection attempt on the caller's thread
    assert stats.flush() is False and stats.counts["errors"] >= 1
    redis_server.restart()
    assert stats.flush() is True
    client = redis.Redis.from_url(redis_server.url)
    assert (
        sum(float(client.hget(bucket_key(10, T0 + 10 * i), field_name("5", "x", "requests")) or 0) for i in range(5))
        == 50
    )
    assert client.xlen(STATS_EVENTS_KEY) == 1


def test_each_mark_is_one_marker_and_an_unknown_kind_is_refused(redis_client, redis_url):
    stats = recorder(redis_url, replica="r1", served_version=lambda: "1")
    stats.flush()
    assert stats.events(0, time.time() + 1) == []  # serving a version is not a swap: only a mark is
    stats.mark("swap", "1", by="watcher")
    stats.mark("rollback", None, by="ops")
    stats.mark("rollback", None, by="ops", domain="sql")  # sql's adapter unloaded: a marker of its own
    stats.flush()
    events = stats.events(0, time.time() + 1)
    assert [(e["kind"], e["version"], e["by"], e["domain"]) for e in events] == [
        ("swap", "1", "watcher", None),
        ("rollback", "base", "ops", None),
        ("rollback", "base", "ops", "sql"),
    ]
    with pytest.raises(ValueError):
        stats.mark("teleport", "1")


def test_markers_of_one_swap_on_several_replicas_merge(redis_client, redis_url):
    replicas = [recorder(redis_url, replica=f"r{i}") for i in range(3)]
    for stats in replicas:
        stats.mark("swap", "3", by="watcher")
        stats.flush()
    events = replicas[0].events(0, time.time() + 1)
    assert len(events) == 1 and events[0]["replicas"] == 3


def gate_metadata(greedy_match: float, expected_acceptance: float) -> AdapterMetadata:
    return AdapterMetadata(
        version=3,
        loss=1.5,
        gate={
            "candidate": {"greedy_match": greedy_match, "expected_acceptance": expected_acceptance, "positions": 432},
            "champion": {"greedy_match": 0.1, "expected_acceptance": 0.1, "positions": 432},
            "reason": "gain",
        },
    )


@pytest.mark.parametrize("accepted_first, alert", [(2, True), (5, False)])  # of 10 drafting steps per request
def test_drift_alert_compares_first_token_acceptance_with_the_gate(redis_client, redis_url, accepted_first, alert):
    stats = recorder(redis_url, drift=DriftSettings(window_s=600, fraction=0.7, min_drafts=100))
    stats.mark("swap", "3", by="test", metadata=gate_metadata(greedy_match=0.6, expected_acceptance=0.4))
    now = time.time()
    steps = [(4, 1)] * accepted_first + [(4, 0)] * (10 - accepted_first)
    for i in range(12):  # 120 drafting steps: 90 greedy, 30 sampled
        stats.record(request_stats(steps, "3"), domain="d", greedy=i < 9, ended_at=now - 30 - i)
    stats.flush()
    state = stats.drift("3", now=now)
    expected = 0.75 * 0.6 + 0.25 * 0.4  # the window's greedy share mixes the two gate figures
    assert state.expected == pytest.approx(expected)
    assert state.first_token_acceptance == pytest.approx(accepted_first / 10)
    assert state.threshold == pytest.approx(0.7 * expected)
    assert state.alert is alert
    assert stats.drift("3", now=now + 3600).alert is False  # the window moved past the traffic
    assert stats.drift(None, now=now).alert is False  # the base draft has no gate figures


def test_drift_alert_waits_for_enough_traffic(redis_client, redis_url):
    stats = recorder(redis_url, drift=DriftSettings(window_s=600, fraction=0.7, min_drafts=100))
    stats.mark("swap", "3", metadata=gate_metadata(0.6, 0.4))
    stats.record(request_stats([(4, 0)] * 10, "3"), domain=None, greedy=True, ended_at=time.time() - 5)
    stats.flush()
    state = stats.drift("3")
    assert state.first_token_acceptance == 0.0 and state.alert is False and "needs 100" in state.reason
    assert redis_client.hexists(STATS_ADAPTERS_KEY, "3")


def test_background_thread_flushes_without_being_asked(redis_client, redis_url):
    stats = StatsRecorder(redis_url, flush_every_s=0.05).start()
    try:
        stats.record(request_stats([(2, 2)], "9"), domain=None, greedy=True, ended_at=T0)
        deadline = time.monotonic() + 5
        while not redis_client.exists(bucket_key(10, T0)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert redis_client.hget(bucket_key(10, T0), field_name("9", "none", "accepted")) == b"2"
    finally:
        stats.close()


def test_pending_buckets_are_bounded_while_redis_is_away():
    stats = StatsRecorder("redis://127.0.0.1:1/0", flush_every_s=3600)  # nothing listens on port 1
    for i in range(2000):  # 2000 distinct 10 s buckets: more than MAX_PENDING_KEYS with their parents
        stats.record(request_stats([(1, 1)], "1"), domain=None, greedy=True, ended_at=T0 + 10 * i)
    assert stats.flush() is False
    assert len(stats._pending) <= MAX_PENDING_KEYS and stats.counts["dropped_keys"] > 0
    newest = bucket_key(10, T0 + 10 * 1999)
    assert newest in stats._pending  # the oldest go first
