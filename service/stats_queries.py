"""Reading the dashboard store: series, totals, markers and gate figures over the buckets that every
server adds into (service/stats_store.py writes them).

    stats.series(now - 86400, now)   # GET /api/stats/series: figures per step, by version and by domain
    stats.events(now - 3600, now)    # GET /api/stats/events: swap and rollback markers, merged across replicas
    stats.totals(start, end)         # sums per (version, domain), for the summary and the drift alert

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
"""

from __future__ import annotations

import json
import math
import time

import redis

from adaptive_spec.contracts import STATS_ADAPTERS_KEY, STATS_EVENTS_KEY, TRAINER_STATUS_KEY, stats_bucket_key
from adaptive_spec.formats.stats import Totals
from adaptive_spec.formats.status import TrainerStatusRecord

RESOLUTIONS = (10, 60, 600)  # bucket sizes (s)
FINE_RETENTION_CAP_S = 2 * 86400  # 10 s buckets live at most this long
MAX_POINTS = 2200  # a series never has more points: 6 h of 10 s, 24 h of 60 s, 7 days of 600 s
# Bucket hashes one request may read: 7 days of 60 s buckets (10,080) pass, 2 days of 10 s ones (17,280) do not. Before
# this cap, 31 days at a step of 1220 s (a multiple of 10 only) read 267,840 10 s buckets, most long expired.
MAX_BUCKETS = 12_000
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
BASE, TARGET_ALONE = "base", "target"
MERGE_S = 60  # markers of one change (same kind, version, author and domain) within this long are one marker


def field_name(version: str, domain: str, name: str) -> str:
    return f"{version}|{domain}|{name}"


class StatsQueries:
    """The dashboard's reads; a StatsRecorder is one (it gives `redis` and `retention_s`)."""

    redis: redis.Redis
    retention_s: int

    def _ttl(self, resolution: int) -> int:
        if resolution == RESOLUTIONS[0]:
            return max(resolution, min(self.retention_s, FINE_RETENTION_CAP_S))
        return max(resolution, self.retention_s)

    # ------------------------------------------------------------------ reading (the API, in a threadpool)

    def resolution_for(self, start: float, end: float, step: int | None = None) -> tuple[int, int]:
        """(bucket size read, step returned). A given step is read from the coarsest buckets that
        make it up; otherwise the finest buckets still retained that give at most MAX_POINTS. Either way
        the buckets read, counted over what retention still keeps (`read_window`), are at most MAX_BUCKETS:
        ValueError says which step to use otherwise.

        Example: 31 days at step 1220 s: only 10 s buckets make up 1220 s, 10 s buckets live 2 days, so it
        would read 17,280: refused ("use a multiple of 60"); at step 1800 it reads 4,464 of 600 s."""
        if step is not None:
            if step % RESOLUTIONS[0] or (end - start) / step > MAX_POINTS:
                raise ValueError(f"step must be a multiple of {RESOLUTIONS[0]} s giving at most {MAX_POINTS} points")
            resolution = next(r for r in reversed(RESOLUTIONS) if step % r == 0)
            if self.buckets_read(start, end, resolution) > MAX_BUCKETS:
                raise ValueError(
                    f"step {step} s is read from {resolution} s buckets: {self.buckets_read(start, end, resolution)} "
                    f"of them, over the {MAX_BUCKETS} one request may read; use a multiple of "
                    f"{next(r for r in RESOLUTIONS if r > resolution)} s"
                )
            return resolution, step
        now = time.time()
        for resolution in RESOLUTIONS:
            if (end - start) / resolution <= MAX_POINTS and start >= now - self._ttl(resolution) - resolution:
                return resolution, resolution
        return RESOLUTIONS[-1], RESOLUTIONS[-1] * max(1, math.ceil((end - start) / RESOLUTIONS[-1] / MAX_POINTS))

    def read_window(self, start: float, end: float, resolution: int) -> tuple[float, float]:
        """The part of [start, end) where buckets of `resolution` can exist: not expired, not in the future."""
        now = time.time()
        return max(start, now - self._ttl(resolution) - resolution), min(end, now + resolution)

    def buckets_read(self, start: float, end: float, resolution: int) -> int:
        first, last = self.read_window(start, end, resolution)
        return max(0, math.ceil(last / resolution) - int(first // resolution))

    def read_buckets(self, start: float, end: float, resolution: int) -> list[tuple[int, dict[str, float]]]:
        """[(bucket start, {field: value})] for every bucket overlapping [start, end) that retention still
        keeps (none past it is read), oldest first."""
        start, end = self.read_window(start, end, resolution)
        if start >= end:
            return []
        first = int(start // resolution * resolution)
        starts = list(range(first, math.ceil(end), resolution))  # b < end: int(end) would drop the bucket under way
        pipe = self.redis.pipeline(transaction=False)
        for bucket in starts:
            pipe.hgetall(stats_bucket_key(resolution, bucket))
        return [
            (bucket, {k.decode(): float(v) for k, v in raw.items()})
            for bucket, raw in zip(starts, pipe.execute(), strict=True)
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
        """Swap and rollback markers in [start, end], oldest first: one per change, with the replicas
        that reported it counted (each server marks the swaps its watcher makes)."""
        # entry ids are write times, which trail the event's own time by at most a flush or a Redis outage
        raw = self.redis.xrange(
            STATS_EVENTS_KEY, max(0, int((start - 600) * 1000)), int((end + 3600) * 1000), count=limit
        )
        entries = sorted((_decode(fields) for _, fields in raw), key=lambda fields: float(fields.get("t", 0)))
        merged: list[dict] = []
        for fields in entries:
            t = float(fields.get("t", 0))
            if not start <= t <= end:
                continue
            event = {key: fields.get(key) for key in ("kind", "version", "by", "domain")} | {"t": t}
            same = next((e for e in reversed(merged[-20:]) if _same_change(e, event)), None)
            if same is not None:
                same["replicas"] += 1
            else:
                merged.append({**event, "replicas": 1})
        return merged

    def trainer_status(self) -> dict | None:
        """The trainer's last word (adaptive_spec/formats/status.py): what it did last or waits for; None if none is kept."""
        raw = self.redis.get(TRAINER_STATUS_KEY)
        return TrainerStatusRecord.from_json(raw).as_dict() if raw else None

    def adapter_info(self, version: str | None) -> dict | None:
        raw = self.redis.hget(STATS_ADAPTERS_KEY, version_label(version))
        return json.loads(raw) if raw else None


def figures(sums: dict[str, float], baseline: dict[str, float] | None = None) -> dict[str, float | None]:
    """The plotted figures of one set of summed fields (see the module docstring)."""
    totals = totals_of(sums)
    tokens_per_s = ratio(sums.get("tokens", 0.0), sums.get("decode_s"))
    baseline_tok_s = ratio(baseline.get("tokens", 0.0), baseline.get("decode_s")) if baseline else None
    return {
        "acceptance_rate": totals.acceptance_rate,
        "mean_acceptance_length": totals.mean_acceptance_length,
        "first_token_acceptance": ratio(sums.get("accepted_first", 0.0), sums.get("drafts")),
        "draft_k": ratio(sums.get("drafted", 0.0), sums.get("target_forwards")),  # chosen k per step, 0s included
        "tokens_per_s": tokens_per_s,
        "speedup": ratio(tokens_per_s, baseline_tok_s) if tokens_per_s is not None else None,
        "requests": int(sums.get("requests", 0)),
        "drafted": int(sums.get("drafted", 0)),
        "tokens": int(sums.get("tokens", 0)),
    }


_SERIES = (
    "acceptance_rate",
    "mean_acceptance_length",
    "first_token_acceptance",
    "draft_k",
    "tokens_per_s",
    "speedup",
    "requests",
)


def _figures_series(slots: list[dict | None], baseline: list[dict | None] | None) -> dict[str, list]:
    out: dict[str, list] = {name: [] for name in _SERIES}
    for i, sums in enumerate(slots):
        values = figures(sums, baseline[i] if baseline else None) if sums else {}
        for name in _SERIES:
            value = values.get(name)
            out[name].append(round(value, 4) if isinstance(value, float) else value)
    return out


def totals_of(sums: dict[str, float]) -> Totals:
    """The summed fields of buckets as stats totals (`tokens` are the emitted ones)."""
    return Totals(
        sums.get("drafted", 0.0), sums.get("accepted", 0.0), sums.get("tokens", 0.0), sums.get("target_forwards", 0.0)
    )


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def _same_change(event: dict, other: dict) -> bool:
    same = all(event[key] == other[key] for key in ("kind", "version", "by", "domain"))
    return same and other["t"] - event["t"] < MERGE_S


def version_label(version: str | None) -> str:
    return BASE if version is None else str(version)


def _decode(fields: dict) -> dict[str, str]:
    return {
        (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
        for k, v in fields.items()
    }
