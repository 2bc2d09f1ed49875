"""The dashboard store: per-request stats summed into time buckets in plain Redis, so replicas add up.

    stats = StatsRecorder(redis_url, retention_s=7 * 86400, served_version=lambda: engine.adapter_version)
    stats.record(output.stats, domain="sql", greedy=True)     # worker thread: memory only, never waits
    stats.mark("rollback", "3", by="ops@admin-api")           # a marker on the chart (the watcher's swaps)
    stats.series(now - 86400, now)                            # what GET /api/stats/series returns

STYLE.md §12: `RequestStats` is the record, this module is the aggregator, and its readers
(service/stats_queries.py, service/drift.py) feed the dashboard; Prometheus has its own counters in
`service/metrics.py`. Tests (a real redis-server): `.venv/bin/python -m pytest tests/service/test_stats_store.py -q`.

Redis layout (no RedisTimeSeries: plain hashes and one stream):

| key | type | holds |
|---|---|---|
| `adaptive_spec:stats:b:{res}:{start}` | hash | one bucket of `res` s (10, 60, 600) from unix time `start`; field `{version}\\|{domain}\\|{name}` |
| `adaptive_spec:stats:events` | stream | swap and rollback markers: kind, version, by, replica, and domain for a domain's adapter (`MAXLEN ~ 10000`) |
| `adaptive_spec:stats:adapters` | hash | version -> JSON of the adapter's gate figures, written when a server loads it; every flush renews its EXPIRE of `retention_s`, so it lives as long as the buckets it explains |

`version` is the served adapter version, "base" for the base draft, or "target" for requests
decoded by the target alone (`speculative=False`, the speed baseline). `domain` is the request's
tag or "none"; at most `MAX_DOMAINS` distinct tags per server, the rest count as "other".
`name` is one of `FIELDS`. Every server HINCRBYs the same fields, so the sum over replicas is
what Redis holds. Each bucket key gets an EXPIRE: 10 s buckets live min(retention, 2 days)
(they serve ranges up to 6 h), 60 s and 600 s buckets live `retention_s`.

Writes never touch the request path: `record` adds to an in-memory dict under a lock, and a
background thread flushes it every second in one pipeline (HINCRBY/HINCRBYFLOAT + EXPIRE).
When Redis is down the increments wait, merged per bucket (at most `MAX_PENDING_KEYS` bucket
keys, about an hour of traffic; older ones are dropped and counted), and go out when it returns.

Swap markers have one path: `mark`, called by whoever swapped and can say who asked for it (in a
server, the adapter watcher's callback `Service.record_swap`, with the adapter's gate figures).
Code that swaps a served engine itself calls `Service.record_swap` too.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import redis

from adaptive_spec.contracts import STATS_ADAPTERS_KEY, STATS_EVENTS_KEY, stats_bucket_key
from adaptive_spec.formats.adapter_metadata import AdapterMetadata
from adaptive_spec.formats.adapters import AdapterDir, AdapterError
from adaptive_spec.formats.stats import RequestStats
from service.drift import DriftSettings, DriftState, check
from service.metrics import DomainLabels
from service.stats_queries import (
    BASE,
    FINE_RETENTION_CAP_S,
    RESOLUTIONS,
    TARGET_ALONE,
    StatsQueries,
    field_name,
    version_label,
)

log = logging.getLogger(__name__)

MAX_PENDING_KEYS = 3 * 360  # an hour of 10 s buckets with their 60 s and 600 s parents
EVENTS_MAXLEN = 10_000
MARK_KINDS = ("swap", "rollback", "promote")


FLUSH_TIMEOUT_S = 15.0  # see StatsRecorder.__init__


class StatsRecorder(StatsQueries):
    """Aggregates finished requests into Redis buckets off the request path, and reads them back."""

    def __init__(
        self,
        redis_url: str,
        *,
        retention_s: float = 7 * 86400,
        drift: DriftSettings | None = None,
        served_version: Callable[[], str | None] | None = None,
        flush_every_s: float = 1.0,
        replica: str | None = None,
        client: redis.Redis | None = None,
    ) -> None:
        # A flush that times out after Redis applied it is kept and sent again, and its increments count twice:
        # the timeout is long (the flush runs on its own thread, never on a request's path) so that only a Redis
        # that is really stuck hits it. At 2 s, a loaded 2-core machine running a fleet hit it and the dashboard
        # counted 5% more requests than were answered.
        self.redis = client or redis.Redis.from_url(
            redis_url, socket_timeout=FLUSH_TIMEOUT_S, socket_connect_timeout=1.0, health_check_interval=30
        )
        self.retention_s = int(retention_s)
        self.drift_settings = drift or DriftSettings()
        self.served_version = served_version  # what the engine serves now, for the drift check; None: unknown
        self.flush_every_s = flush_every_s
        self.replica = replica or f"{socket.gethostname()}:{os.getpid()}"
        self.drift_state = DriftState()
        self._pending: dict[str, dict[str, float]] = {}  # bucket key -> field -> increment
        self._pending_events: list[dict[str, str]] = []
        self._pending_adapters: dict[str, str] = {}
        self._domains = DomainLabels()
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.counts = {"requests": 0, "flushes": 0, "errors": 0, "dropped_keys": 0, "events": 0}

    # ------------------------------------------------------------------ writing (never blocks)

    def start(self) -> StatsRecorder:
        """Flush every `flush_every_s` from a thread."""
        self._thread = threading.Thread(target=self._run, name="stats-flusher", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 3.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.flush()

    def record(
        self,
        stats: RequestStats,
        *,
        domain: str | None,
        greedy: bool,
        speculative: bool = True,
        ended_at: float | None = None,
    ) -> None:
        """Count one finished request in the buckets of `ended_at` (default now). Memory only."""
        ended_at = time.time() if ended_at is None else ended_at
        version = (stats.adapter_version or BASE) if speculative else TARGET_ALONE
        drafts = stats.drafted_per_pos[0] if stats.drafted_per_pos else 0
        values = {
            "requests": 1,
            "tokens": stats.emitted,
            "drafted": stats.drafted,
            "accepted": stats.accepted,
            "drafts": drafts,
            "accepted_first": stats.accepted_per_pos[0] if stats.accepted_per_pos else 0,
            "drafts_greedy": drafts if greedy else 0,
            "target_forwards": stats.target_forwards,
            "decode_s": max(0.0, stats.wall_s - stats.prefill_s),
        }
        with self._lock:
            label = self._domain_label(domain)
            for resolution in RESOLUTIONS:
                key = stats_bucket_key(resolution, int(ended_at // resolution * resolution))
                bucket = self._pending.get(key)
                if bucket is None:
                    bucket = self._pending[key] = {}
                    self._drop_oldest_if_full()
                for name, value in values.items():
                    if value:
                        field = field_name(version, label, name)
                        bucket[field] = bucket.get(field, 0) + value
            self.counts["requests"] += 1

    def mark(
        self,
        kind: str,
        version: str | None,
        by: str | None = None,
        *,
        adapter_dir: str | Path | None = None,
        metadata: AdapterMetadata | None = None,
        at: float | None = None,
        domain: str | None = None,
    ) -> None:
        """Record a swap or rollback to `version` (None = the base draft) by `by`, at `at` (default
        now), of the general adapter or (`domain`) of that domain's. Never blocks.

        `adapter_dir` (or its parsed `metadata`) also stores the adapter's gate figures, which
        the summary and the drift alert compare live acceptance with."""
        if kind not in MARK_KINDS:
            raise ValueError(f"kind must be one of {MARK_KINDS}, got {kind!r}")
        if metadata is None and adapter_dir is not None:
            metadata = _metadata(AdapterDir(adapter_dir))
        if metadata is not None and not metadata.empty:
            self.adapter_loaded(version, metadata)
        self._queue_event(kind, version, by or "unknown", at, domain)

    def adapter_loaded(self, version: str | None, metadata: AdapterMetadata) -> None:
        """Keep an adapter's gate figures (from its adaptive_spec_adapter.json) for the summary."""
        info = {"version": version_label(version), **metadata.describe(), "loaded_at": time.time()}
        with self._lock:
            self._pending_adapters[version_label(version)] = json.dumps(info, default=_json_safe)

    def _queue_event(self, kind: str, version: str | None, by: str, at: float | None, domain: str | None) -> None:
        event = {
            "kind": kind,
            "version": version_label(version),
            "by": by,
            "replica": self.replica,
            "t": f"{time.time() if at is None else at:.3f}",
        }
        if domain is not None:  # a stream entry holds strings only: the general adapter's has no field
            event["domain"] = domain
        with self._lock:
            if len(self._pending_events) < 1000:
                self._pending_events.append(event)
            self.counts["events"] += 1

    def _domain_label(self, domain: str | None) -> str:
        return self._domains(None if domain is None else domain.replace("|", "_"))  # "|" separates field parts

    def _drop_oldest_if_full(self) -> None:
        while len(self._pending) > MAX_PENDING_KEYS:
            oldest = min(self._pending, key=lambda key: int(key.rsplit(":", 1)[1]))
            del self._pending[oldest]
            self.counts["dropped_keys"] += 1

    def _run(self) -> None:
        next_drift = 0.0
        while not self._stop.wait(self.flush_every_s):
            self.flush()
            if time.monotonic() >= next_drift:
                next_drift = time.monotonic() + min(10.0, self.drift_settings.window_s)
                try:
                    self.drift_state = self.drift(self.served_version() if self.served_version else None)
                except redis.RedisError as exc:
                    self.counts["errors"] += 1
                    log.debug("drift check failed: %s", exc)

    def flush(self) -> bool:
        """Send what is pending in one pipeline; on failure keep it for the next try. Returns success."""
        with self._flush_lock:
            with self._lock:
                pending, self._pending = self._pending, {}
                events, self._pending_events = self._pending_events, []
                adapters, self._pending_adapters = self._pending_adapters, {}
            if not pending and not events and not adapters:
                return True
            try:
                pipe = self.redis.pipeline(transaction=False)
                for key, increments in pending.items():
                    resolution = int(key.split(":")[-2])
                    for field, value in increments.items():
                        if isinstance(value, float):
                            pipe.hincrbyfloat(key, field, value)
                        else:
                            pipe.hincrby(key, field, value)
                    pipe.expire(key, self._ttl(resolution))
                if adapters:
                    pipe.hset(STATS_ADAPTERS_KEY, mapping=adapters)
                pipe.expire(STATS_ADAPTERS_KEY, self.retention_s)  # renewed while traffic flows, as the buckets are
                for event in events:
                    pipe.xadd(STATS_EVENTS_KEY, event, maxlen=EVENTS_MAXLEN, approximate=True)
                pipe.execute()
                self.counts["flushes"] += 1
                return True
            except (redis.RedisError, OSError) as exc:
                self.counts["errors"] += 1
                log.debug("stats flush failed (kept for the next try): %s", exc)
                with self._lock:
                    for key, increments in pending.items():
                        bucket = self._pending.setdefault(key, {})
                        for field, value in increments.items():
                            bucket[field] = bucket.get(field, 0) + value
                    self._drop_oldest_if_full()
                    self._pending_events[:0] = events[: max(0, 1000 - len(self._pending_events))]
                    self._pending_adapters = {**adapters, **self._pending_adapters}
                return False

    def _ttl(self, resolution: int) -> int:
        if resolution == RESOLUTIONS[0]:
            return max(resolution, min(self.retention_s, FINE_RETENTION_CAP_S))
        return max(resolution, self.retention_s)

    def drift(self, version: str | None, now: float | None = None) -> DriftState:
        """Evaluate the drift alert for `version` over the last window (all replicas)."""
        settings = self.drift_settings
        now = time.time() if now is None else now
        label = version_label(version)
        sums: dict[str, float] = {}
        for (v, _), fields in self.totals(now - settings.window_s, now + 1).items():
            if v == label:
                for name, value in fields.items():
                    sums[name] = sums.get(name, 0.0) + value
        info = self.adapter_info(version) if version is not None else None
        return check(sums, ((info or {}).get("gate") or {}).get("candidate") or {}, label, settings, now)


def _metadata(adapter: AdapterDir) -> AdapterMetadata:
    """A marker with no gate figures beats no marker: an unreadable metadata file reads as empty."""
    try:
        return adapter.metadata()
    except AdapterError:
        return AdapterMetadata()


def _json_safe(value):
    return str(value)
