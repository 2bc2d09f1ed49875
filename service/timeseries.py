"""The dashboard store: per-request stats summed into time buckets in plain Redis, so replicas add up.

    stats = StatsRecorder(redis_url, retention_s=7 * 86400)   # Service.start builds it when REDIS_URL is set
    stats.record(output.stats, domain="sql", greedy=True)     # worker thread: memory only, never waits
    stats.mark("rollback", "3", by="ops@admin-api")           # a marker on the chart (the watcher calls it)
    stats.series(now - 86400, now)                            # what GET /api/stats/series returns

STYLE.md §12: `RequestStats` is the record, this module is the aggregator, and its readers are
the dashboard's exporter (Prometheus has its own counters in `service/metrics.py`).

Redis layout (no RedisTimeSeries: plain hashes and one stream):

| key | type | holds |
|---|---|---|
| `adaptive_spec:stats:b:{res}:{start}` | hash | one bucket of `res` s (10, 60, 600) from unix time `start`; field `{version}\\|{domain}\\|{name}` |
| `adaptive_spec:stats:events` | stream | swap and rollback markers: kind, version, by, replica (`MAXLEN ~ 10000`) |
| `adaptive_spec:stats:adapters` | hash | version -> JSON of the adapter's gate figures, written when a server loads it |

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

The formulas the dashboard plots, for any set of buckets and labels (sums of the fields):

    acceptance rate          = accepted / drafted
    mean acceptance length   = tokens / target_forwards           (stats.py: emitted per decoding forward)
    first-token acceptance   = accepted_first / drafts            (drafts = steps that drafted)
    tokens/s                 = tokens / decode_s                   (decode_s = wall - prefill, per request)
    speedup                  = tokens/s of a version / tokens/s of "target" over the same buckets

Example: a bucket with 2 requests of adapter "4" that drafted 40 tokens in 10 steps, accepted 30
(8 of them at the first position), emitted 40 tokens in 10 forwards and decoded for 0.5 s gives
acceptance rate 0.75, mean acceptance length 4.0, first-token acceptance 0.8 and 80 tokens/s.

Speedup is shown only where it is measured: the same buckets must also hold target-alone
requests. It is not estimated from the verify time of speculative steps, because a verify of
k + 1 tokens costs more than a plain step, which would overstate the speedup. Output length and
context length differ between the two groups, so it is a traffic-level figure, not a benchmark.

Drift (`drift`): over the last `window_s`, the served version's first-token acceptance, summed
over all replicas, is compared with what the gate measured for it on held-out traffic. The
first draft token of a step is scored in exactly the context the gate used (teacher forcing),
so the comparable figures are the gate's greedy match for greedy requests and its expected
acceptance (sum of min(draft, target) probabilities) for sampled ones, weighted by the window's
mix. Example: gate greedy match 0.63, expected acceptance 0.55, a window of 900 greedy and 100
sampled drafting steps -> expected 0.622; the alert fires below 0.7 x 0.622 = 0.435, and only
when the window holds at least `min_drafts` drafting steps.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis

from adaptive_spec.adapters import AdapterDir, AdapterError, describe, locate
from adaptive_spec.contracts import STATS_ADAPTERS_KEY, STATS_EVENTS_KEY
from adaptive_spec.contracts import stats_bucket_key as bucket_key
from adaptive_spec.stats import RequestStats
from service.metrics import DomainLabels

log = logging.getLogger(__name__)

RESOLUTIONS = (10, 60, 600)  # bucket sizes (s)
FINE_RETENTION_CAP_S = 2 * 86400  # 10 s buckets live at most this long
MAX_POINTS = 2200  # a series never has more points: 6 h of 10 s, 24 h of 60 s, 7 days of 600 s
FIELDS = (
    "requests",
    "tokens",
    "drafted",
    "accepted",
    "drafts",
    "accepted_first",
    "drafts_greedy",
    "target_forwards",
    "decode_s",
)
MAX_DOMAINS = 32
MAX_PENDING_KEYS = 3 * 360  # an hour of 10 s buckets with their 60 s and 600 s parents
EVENTS_MAXLEN = 10_000
BASE, TARGET_ALONE = "base", "target"
MARK_KINDS = ("swap", "rollback", "promote")


def field_name(version: str, domain: str, name: str) -> str:
    return f"{version}|{domain}|{name}"


@dataclass(frozen=True)
class DriftSettings:
    window_s: float = 600.0
    fraction: float = 0.7
    min_drafts: int = 200


@dataclass
class DriftState:
    """What the alert saw last: `alert` is True only with a reference and enough traffic."""

    version: str | None = None
    alert: bool = False
    reason: str = "not evaluated yet"
    acceptance_rate: float | None = None  # accepted / drafted over the window
    first_token_acceptance: float | None = None  # accepted_first / drafts over the window
    expected: float | None = None  # the gate's figure, mixed by the window's greedy share
    threshold: float | None = None  # fraction * expected
    drafts: int = 0
    evaluated_at: float | None = None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class StatsRecorder:
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
        metadata_for: Callable[[str], dict | None] | None = None,
    ) -> None:
        self.redis = client or redis.Redis.from_url(
            redis_url, socket_timeout=2.0, socket_connect_timeout=1.0, health_check_interval=30
        )
        self.retention_s = int(retention_s)
        self.drift_settings = drift or DriftSettings()
        self.served_version = served_version  # what the engine serves now; None: unknown
        self.metadata_for = metadata_for  # version -> adapter metadata, for marks that came without it
        self.flush_every_s = flush_every_s
        self.replica = replica or f"{socket.gethostname()}:{os.getpid()}"
        self.drift_state = DriftState()
        self._pending: dict[str, dict[str, float]] = {}  # bucket key -> field -> increment
        self._pending_events: list[dict[str, str]] = []
        self._pending_adapters: dict[str, str] = {}
        self._known_adapters: set[str] = set()  # versions whose gate figures were stored or looked for
        self._domains = DomainLabels(MAX_DOMAINS)
        self._last_version: object = _UNSEEN
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.counts = {"requests": 0, "flushes": 0, "errors": 0, "dropped_keys": 0, "events": 0}

    # ------------------------------------------------------------------ writing (never blocks)

    def start(self) -> StatsRecorder:
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
                key = bucket_key(resolution, int(ended_at // resolution * resolution))
                bucket = self._pending.get(key)
                if bucket is None:
                    bucket = self._pending[key] = {}
                    self._drop_oldest_if_full()
                for name, value in values.items():
                    if value:
                        field = field_name(version, label, name)
                        bucket[field] = bucket.get(field, 0) + value
            self.counts["requests"] += 1
        if speculative:
            self.observe_version(stats.adapter_version, at=ended_at)

    def observe_version(self, version: str | None, at: float | None = None) -> None:
        """A swap marker when the served version differs from the one last seen or marked here.

        The first version seen is the starting point, not a swap. An explicit `mark` for the same
        version later replaces the observed marker's kind and author (see `mark`). A request that
        finished on the old version but is counted after the swap is not a swap back: an
        observation that is no longer what the engine serves is ignored."""
        if self.served_version is not None and _label(version) != _label(self.served_version()):
            return
        with self._lock:
            previous, self._last_version = self._last_version, _label(version)
        if previous is not _UNSEEN and previous != _label(version):
            self._queue_event("swap", version, "observed", at)

    def mark(
        self,
        kind: str,
        version: str | None,
        by: str | None = None,
        *,
        adapter_dir: str | Path | None = None,
        metadata: dict | None = None,
        at: float | None = None,
    ) -> None:
        """Record a swap or rollback to `version` (None = the base draft) by `by`, at `at` (default
        now). Never blocks.

        `adapter_dir` (or its parsed `metadata`) also stores the adapter's gate figures, which
        the summary and the drift alert compare live acceptance with."""
        if kind not in MARK_KINDS:
            raise ValueError(f"kind must be one of {MARK_KINDS}, got {kind!r}")
        if metadata is None and adapter_dir is not None:
            metadata = _metadata(AdapterDir(adapter_dir))
        if metadata:
            self.adapter_loaded(version, metadata)
        with self._lock:
            self._last_version = _label(version)
            # the request path may have seen this swap first: the explicit marker supersedes it
            self._pending_events = [
                e for e in self._pending_events if not (e["by"] == "observed" and e["version"] == _label(version))
            ]
        self._queue_event(kind, version, by or "unknown", at, supersede_observed=True)

    def adapter_loaded(self, version: str | None, metadata: dict) -> None:
        """Keep an adapter's gate figures (from its adaptive_spec_adapter.json) for the summary."""
        info = {"version": _label(version), **describe(metadata), "loaded_at": time.time()}
        with self._lock:
            self._pending_adapters[_label(version)] = json.dumps(info, default=_json_safe)
            self._known_adapters.add(_label(version))

    def _queue_event(
        self, kind: str, version: str | None, by: str, at: float | None, supersede_observed: bool = False
    ) -> None:
        event = {
            "kind": kind,
            "version": _label(version),
            "by": by,
            "replica": self.replica,
            "t": f"{time.time() if at is None else at:.3f}",
            "supersede": "1" if supersede_observed else "",
        }
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
            self._look_up_metadata([e["version"] for e in events])
            with self._lock:
                adapters.update(self._pending_adapters)
                self._pending_adapters = {}
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
                for event in events:
                    supersede = event.pop("supersede", "")
                    if supersede:
                        self._supersede_observed(event)
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

    def _look_up_metadata(self, versions: list[str]) -> None:
        """Gate figures of versions marked without them (an observed swap, a watcher's mark)."""
        for version in dict.fromkeys(versions):
            if version == BASE or version in self._known_adapters or self.metadata_for is None:
                continue
            self._known_adapters.add(version)
            try:
                metadata = self.metadata_for(version)
            except Exception:  # a marker without figures is better than no marker
                log.exception("looking up the metadata of adapter %s failed", version)
                continue
            if metadata:
                self.adapter_loaded(version, metadata)

    def _supersede_observed(self, event: dict[str, str]) -> None:
        """Delete this replica's recent observed marker for the same version (flushed already)."""
        since = int((float(event["t"]) - 300) * 1000)
        for entry_id, fields in self.redis.xrevrange(STATS_EVENTS_KEY, "+", since, count=20):
            fields = _decode(fields)
            if (
                fields.get("by") == "observed"
                and fields.get("replica") == self.replica
                and fields.get("version") == event["version"]
            ):
                self.redis.xdel(STATS_EVENTS_KEY, entry_id)

    def _ttl(self, resolution: int) -> int:
        if resolution == RESOLUTIONS[0]:
            return max(resolution, min(self.retention_s, FINE_RETENTION_CAP_S))
        return max(resolution, self.retention_s)

    # ------------------------------------------------------------------ reading (the API, in a threadpool)

    def resolution_for(self, start: float, end: float, step: int | None = None) -> tuple[int, int]:
        """(bucket size read, step returned). A given step is read from the coarsest buckets that
        make it up; otherwise the finest buckets still retained that give at most MAX_POINTS."""
        if step is not None:
            if step % RESOLUTIONS[0] or (end - start) / step > MAX_POINTS:
                raise ValueError(f"step must be a multiple of {RESOLUTIONS[0]} s giving at most {MAX_POINTS} points")
            return next(r for r in reversed(RESOLUTIONS) if step % r == 0), step
        now = time.time()
        for resolution in RESOLUTIONS:
            if (end - start) / resolution <= MAX_POINTS and start >= now - self._ttl(resolution) - resolution:
                return resolution, resolution
        return RESOLUTIONS[-1], RESOLUTIONS[-1] * max(1, math.ceil((end - start) / RESOLUTIONS[-1] / MAX_POINTS))

    def read_buckets(self, start: float, end: float, resolution: int) -> list[tuple[int, dict[str, float]]]:
        """[(bucket start, {field: value})] for every bucket overlapping [start, end), oldest first."""
        first = int(start // resolution * resolution)
        starts = list(range(first, math.ceil(end), resolution))  # b < end: int(end) would drop the bucket under way
        pipe = self.redis.pipeline(transaction=False)
        for bucket in starts:
            pipe.hgetall(bucket_key(resolution, bucket))
        return [
            (bucket, {k.decode(): float(v) for k, v in raw.items()})
            for bucket, raw in zip(starts, pipe.execute())
            if raw
        ]

    def series(self, start: float, end: float, step: int | None = None) -> dict:
        """Every plotted figure per step, by adapter version and by domain (nulls where no traffic)."""
        resolution, step = self.resolution_for(start, end, step)
        first = int(start // step * step)
        times = list(range(first, math.ceil(end), step))
        index = {t: i for i, t in enumerate(times)}
        by_version: dict[str, list[dict]] = {}
        by_domain: dict[str, list[dict]] = {}
        parsed: dict[str, list[tuple[list, str]]] = {}  # field -> [(the series it adds to, name)], parsed once
        for bucket, fields in self.read_buckets(start, end, resolution):
            slot = index.get(bucket // step * step)
            if slot is None:
                continue
            for field, value in fields.items():
                targets = parsed.get(field)
                if targets is None:
                    version, domain, name = field.split("|", 2)
                    targets = parsed[field] = [(by_version.setdefault(version, [None] * len(times)), name)]
                    if version != TARGET_ALONE:  # the baseline is not a domain's traffic
                        targets.append((by_domain.setdefault(domain, [None] * len(times)), name))
                for sums, name in targets:
                    if sums[slot] is None:
                        sums[slot] = {}
                    sums[slot][name] = sums[slot].get(name, 0.0) + value
        baseline = by_version.get(TARGET_ALONE)
        return {
            "from": start,
            "to": end,
            "step": step,
            "resolution": resolution,
            "t": times,
            "by_version": {v: _figures_series(s, baseline) for v, s in sorted(by_version.items())},
            "by_domain": {d: _figures_series(s, None) for d, s in sorted(by_domain.items())},
        }

    def totals(self, start: float, end: float) -> dict[tuple[str, str], dict[str, float]]:
        """Sums of every field over [start, end) per (version, domain), from the coarsest buckets that fit."""
        resolution = next((r for r in reversed(RESOLUTIONS) if (end - start) >= 20 * r), RESOLUTIONS[0])
        sums: dict[tuple[str, str], dict[str, float]] = {}
        for _, fields in self.read_buckets(start, end, resolution):
            for field, value in fields.items():
                version, domain, name = field.split("|", 2)
                bucket = sums.setdefault((version, domain), {})
                bucket[name] = bucket.get(name, 0.0) + value
        return sums

    def events(self, start: float, end: float, limit: int = 1000) -> list[dict]:
        """Swap and rollback markers in [start, end], oldest first; one per (kind, version, author) a
        minute, with the replicas that reported it counted."""
        # entry ids are write times, which trail the event's own time by at most a flush or a Redis outage
        raw = self.redis.xrange(
            STATS_EVENTS_KEY, max(0, int((start - 600) * 1000)), int((end + 3600) * 1000), count=limit
        )
        merged: list[dict] = []
        for _, fields in sorted(raw, key=lambda entry: float(_decode(entry[1]).get("t", 0))):
            fields = _decode(fields)
            t = float(fields.get("t", 0))
            if not start <= t <= end:
                continue
            event = {
                "t": t,
                "kind": fields.get("kind"),
                "version": fields.get("version"),
                "by": fields.get("by"),
                "replicas": 1,
            }
            same = next(
                (
                    e
                    for e in reversed(merged[-20:])
                    if e["kind"] == event["kind"]
                    and e["version"] == event["version"]
                    and e["by"] == event["by"]
                    and t - e["t"] < 60
                ),
                None,
            )
            if same is not None:
                same["replicas"] += 1
            else:
                merged.append(event)
        return merged

    def adapter_info(self, version: str | None) -> dict | None:
        raw = self.redis.hget(STATS_ADAPTERS_KEY, _label(version))
        return json.loads(raw) if raw else None

    def drift(self, version: str | None, now: float | None = None) -> DriftState:
        """Evaluate the drift alert for `version` over the last window (all replicas)."""
        settings = self.drift_settings
        now = time.time() if now is None else now
        label = _label(version)
        sums: dict[str, float] = {}
        for (v, _), fields in self.totals(now - settings.window_s, now + 1).items():
            if v == label:
                for name, value in fields.items():
                    sums[name] = sums.get(name, 0.0) + value
        drafts = int(sums.get("drafts", 0))
        state = DriftState(
            version=label,
            drafts=drafts,
            evaluated_at=now,
            acceptance_rate=_ratio(sums.get("accepted", 0.0), sums.get("drafted")),
            first_token_acceptance=_ratio(sums.get("accepted_first", 0.0), sums.get("drafts")),
        )
        info = self.adapter_info(version) if version is not None else None
        candidate = ((info or {}).get("gate") or {}).get("candidate") or {}
        greedy_match, expected_acceptance = candidate.get("greedy_match"), candidate.get("expected_acceptance")
        if greedy_match is None and expected_acceptance is None:
            state.reason = "no gate figures for the served version" if version is not None else "base draft: no gate"
            return state
        greedy_share = sums.get("drafts_greedy", 0.0) / drafts if drafts else 1.0
        greedy_match = expected_acceptance if greedy_match is None else greedy_match
        expected_acceptance = greedy_match if expected_acceptance is None else expected_acceptance
        state.expected = greedy_share * greedy_match + (1 - greedy_share) * expected_acceptance
        state.threshold = settings.fraction * state.expected
        if drafts < settings.min_drafts:
            state.reason = f"{drafts} drafting steps in the window, the alert needs {settings.min_drafts}"
            return state
        state.alert = state.first_token_acceptance < state.threshold
        state.reason = (
            f"first-token acceptance {state.first_token_acceptance:.3f} "
            f"{'<' if state.alert else '>='} {settings.fraction} x gated {state.expected:.3f}"
        )
        return state


class StatsCollector:
    """Prometheus view of the recorder: the drift alert and the store's own health, read at scrape time.

    `adaptive_spec:drift_alert` is 1 while the served version's first-token acceptance over the
    last window is below the set fraction of its gated figure (see `StatsRecorder.drift`)."""

    def __init__(self, recorder: StatsRecorder) -> None:
        self.recorder = recorder

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        state, counts, name = self.recorder.drift_state, self.recorder.counts, "adaptive_spec:"
        yield GaugeMetricFamily(
            name + "drift_alert",
            "1 while acceptance over the drift window is below the set fraction of the served adapter's gated figure.",
            value=1.0 if state.alert else 0.0,
        )
        for key, attribute, doc in (
            (
                "acceptance_rate_window",
                "acceptance_rate",
                "Accepted / drafted tokens of the served version over the drift window, all replicas.",
            ),
            (
                "first_token_acceptance_window",
                "first_token_acceptance",
                "Accepted / drafted first draft tokens of the served version over the drift window, all replicas.",
            ),
            (
                "first_token_acceptance_expected",
                "expected",
                "The served adapter's gated figure, for the window's mix of greedy and sampled steps.",
            ),
        ):
            value = getattr(state, attribute)
            yield GaugeMetricFamily(name + key, doc, value=math.nan if value is None else value)
        yield CounterMetricFamily(
            name + "stats_store_errors",
            "Failed writes or reads of the dashboard store (retried).",
            value=counts["errors"],
        )
        yield CounterMetricFamily(
            name + "stats_store_dropped_buckets",
            "Dashboard buckets dropped while Redis was away too long.",
            value=counts["dropped_keys"],
        )


def find_adapter_metadata(data_dir: str | Path, version: str) -> dict | None:
    """The metadata of a served version found in the data directory (adapters.locate), or None."""
    found = locate(data_dir, version)
    return _metadata(found) if found is not None else None


def _metadata(adapter: AdapterDir) -> dict:
    """A marker with no gate figures beats no marker: an unreadable metadata file reads as {}."""
    try:
        return adapter.metadata()
    except AdapterError:
        return {}


def figures(sums: dict[str, float], baseline: dict[str, float] | None = None) -> dict[str, float | None]:
    """The plotted figures of one set of summed fields (see the module docstring)."""
    tokens_per_s = _ratio(sums.get("tokens", 0.0), sums.get("decode_s"))
    baseline_tok_s = _ratio(baseline.get("tokens", 0.0), baseline.get("decode_s")) if baseline else None
    return {
        "acceptance_rate": _ratio(sums.get("accepted", 0.0), sums.get("drafted")),
        "mean_acceptance_length": _ratio(sums.get("tokens", 0.0), sums.get("target_forwards")),
        "first_token_acceptance": _ratio(sums.get("accepted_first", 0.0), sums.get("drafts")),
        "tokens_per_s": tokens_per_s,
        "speedup": _ratio(tokens_per_s, baseline_tok_s) if tokens_per_s is not None else None,
        "requests": int(sums.get("requests", 0)),
        "drafted": int(sums.get("drafted", 0)),
        "tokens": int(sums.get("tokens", 0)),
    }


_SERIES = ("acceptance_rate", "mean_acceptance_length", "first_token_acceptance", "tokens_per_s", "speedup", "requests")


def _figures_series(slots: list[dict | None], baseline: list[dict | None] | None) -> dict[str, list]:
    out: dict[str, list] = {name: [] for name in _SERIES}
    for i, sums in enumerate(slots):
        values = figures(sums, baseline[i] if baseline else None) if sums else {}
        for name in _SERIES:
            value = values.get(name)
            out[name].append(round(value, 4) if isinstance(value, float) else value)
    return out


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def _label(version: str | None) -> str:
    return BASE if version is None else str(version)


def _decode(fields: dict) -> dict[str, str]:
    return {
        (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
        for k, v in fields.items()
    }


def _json_safe(value):
    return str(value)


_UNSEEN = object()
