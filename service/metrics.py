"""Prometheus exporter for the served requests (STYLE.md §12: the engine's `RequestStats` is the
record, these counters are the aggregate, `/metrics` is the export).

Names follow vLLM's (`vllm/v1/spec_decode/metrics.py`) under the prefix `adaptive_spec:`;
counters get prometheus_client's `_total` suffix, as vLLM's do. The dashboard formulas:

    acceptance rate         = rate(adaptive_spec:spec_decode_num_accepted_tokens_total[5m])
                            / rate(adaptive_spec:spec_decode_num_draft_tokens_total[5m])
    mean acceptance length  = 1 + rate(..._num_accepted_tokens_total[5m]) / rate(..._num_drafts_total[5m])
    acceptance at position i = rate(..._num_accepted_tokens_per_pos_total{position="i"}[5m])
                            / rate(..._num_drafts_total[5m])
    chosen k per domain     = sum by (domain) (rate(..._num_draft_tokens_total[5m]))
                            / sum by (domain) (rate(..._num_target_forwards_total[5m]))
      (draft tokens per decoding step, the steps where dynamic k drafted nothing included; the
      dashboard's "mean k" column is the same figure)

Example: 10 drafts of 4 tokens with 30 accepted give acceptance rate 30 / 40 = 0.75 and mean
acceptance length 1 + 30 / 10 = 4.0 (vLLM's convention, which counts only steps that drafted;
`usage.spec_decode.mean_acceptance_length` divides by every target forward instead, so the two
differ when dynamic k skips drafting).

Every spec-decode counter carries `adapter_version` ("base" for the base draft) and `domain`
("none" when the request gave none) labels, so acceptance can be plotted per adapter version
and per domain. At most `MAX_DOMAINS` distinct domains get their own label; the rest count as
"other", which bounds the series a client can create.
"""

from __future__ import annotations

import math
import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from adaptive_spec.formats.stats import RequestStats

PREFIX = "adaptive_spec:"
MAX_DOMAINS = 32


class ServiceMetrics:
    def __init__(self, engine, worker, writer=None) -> None:
        self.registry = CollectorRegistry()
        spec = ["adapter_version", "domain"]
        self.num_drafts = self._counter("spec_decode_num_drafts", "Steps that drafted at least one token.", spec)
        self.num_draft_tokens = self._counter("spec_decode_num_draft_tokens", "Draft tokens verified.", spec)
        self.num_accepted_tokens = self._counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec)
        self.num_free_draft_tokens = self._counter(
            "spec_decode_num_free_draft_tokens",
            "Of the draft tokens verified, those copied by ngram+ drafts (context or n-gram index, no forward).",
            spec,
        )
        self.num_free_accepted_tokens = self._counter(
            "spec_decode_num_free_accepted_tokens", "Of the draft tokens accepted, those copied by ngram+ drafts.", spec
        )
        self.num_target_forwards = self._counter(
            "spec_decode_num_target_forwards",
            "Decoding steps (target forwards) of finished requests: mean acceptance length = emitted / "
            "forwards, mean k = draft tokens / forwards.",
            spec,
        )
        self.num_emitted_tokens = self._counter(
            "spec_decode_num_emitted_tokens", "Tokens emitted by decoding steps (accepted + one per step).", spec
        )
        self.accepted_per_pos = self._counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens at each draft position (0 = first).",
            ["position", *spec],
        )
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens of finished requests.", ["domain"])
        self.generation_tokens = self._counter(
            "generation_tokens", "Generated tokens of finished requests.", ["domain"]
        )
        self.request_success = self._counter("request_success", "Finished requests.", ["finished_reason", "domain"])
        self.requests_cancelled = self._counter(
            "requests_cancelled", "Requests stopped before the end: timeout, disconnect or shutdown.", ["reason"]
        )
        self.requests_rejected = self._counter("requests_rejected", "Requests refused before queueing.", ["reason"])
        self.latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "From arrival to the last token.",
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160),
            registry=self.registry,
        )
        Gauge(
            PREFIX + "num_requests_running", "Requests the engine is decoding now (the batch).", registry=self.registry
        ).set_function(lambda: worker.running)
        # The continuous batch (service/worker.py): mean batch size = rows / steps, mean k = k / steps.
        self.batch_steps = self._counter("batch_steps", "Decoding steps of the batch.", [])
        self.batch_rows = self._counter("batch_rows", "Rows decoded, summed over steps.", [])
        self.batch_draft_k = self._counter("batch_draft_k", "Tokens drafted per row (k), summed over steps.", [])
        self.batch_size = Gauge(PREFIX + "batch_size", "Rows in the latest decoding step.", registry=self.registry)
        Gauge(PREFIX + "num_requests_waiting", "Requests queued for the engine.", registry=self.registry).set_function(
            lambda: worker.waiting
        )
        Gauge(
            PREFIX + "adapter_version",
            "The served draft adapter's version (0 = the base draft, -1 = not a number).",
            registry=self.registry,
        ).set_function(lambda: _version_number(engine.adapter_version))
        # The adapter watcher's (service/watcher.py): swaps by kind (swap, rollback), refusals by reason
        # (missing, checksum, corrupt, incompatible), and the pause of the last swap.
        self.adapter_swaps = self._counter("adapter_swaps", "Adapter swaps done by this server, by kind.", ["kind"])
        self.adapter_refusals = self._counter(
            "adapter_refusals", "Adapter versions refused before any swap.", ["reason"]
        )
        self.adapter_registry_errors = self._counter(
            "adapter_registry_errors", "Alias checks that found the adapter registry unreachable.", []
        )
        self.adapter_swap_pause = Gauge(
            PREFIX + "adapter_swap_pause_seconds",
            "How long the last adapter swap held decoding.",
            registry=self.registry,
        )
        if writer is not None:
            self.registry.register(_CorrectionLogCollector(writer))
        self._domain_label = DomainLabels()

    def observe(
        self,
        stats: RequestStats,
        *,
        domain: str | None,
        finish_reason: str,
        prompt_tokens: int,
        generation_tokens: int,
        latency_s: float,
    ) -> None:
        """Count one finished request."""
        domain = self._domain_label(domain)
        version = stats.adapter_version if stats.adapter_version is not None else "base"
        drafts = stats.drafted_per_pos[0] if stats.drafted_per_pos else 0
        self.num_drafts.labels(version, domain).inc(drafts)
        self.num_draft_tokens.labels(version, domain).inc(stats.drafted)
        self.num_accepted_tokens.labels(version, domain).inc(stats.accepted)
        self.num_free_draft_tokens.labels(version, domain).inc(stats.free_drafted)
        self.num_free_accepted_tokens.labels(version, domain).inc(stats.free_accepted)
        self.num_target_forwards.labels(version, domain).inc(stats.target_forwards)
        self.num_emitted_tokens.labels(version, domain).inc(stats.emitted)
        for position, accepted in enumerate(stats.accepted_per_pos):
            self.accepted_per_pos.labels(str(position), version, domain).inc(accepted)
        self.prompt_tokens.labels(domain).inc(prompt_tokens)
        self.generation_tokens.labels(domain).inc(generation_tokens)
        self.request_success.labels(finish_reason, domain).inc()
        self.latency.observe(latency_s)

    def observe_step(self, rows: int, k: int) -> None:
        """Count one decoding step of the batch: its rows and the k it drafted (EngineWorker.on_step)."""
        self.batch_steps.inc()
        self.batch_rows.inc(rows)
        self.batch_draft_k.inc(k)
        self.batch_size.set(rows)

    def _counter(self, name: str, doc: str, labels: list[str]) -> Counter:
        return Counter(PREFIX + name, doc, labels, registry=self.registry)


class DomainLabels:
    """The label of a request's domain tag: "none" without one, the tag itself for the first
    `limit` distinct tags, "other" after that, so a client cannot create unbounded series."""

    def __init__(self, limit: int = MAX_DOMAINS) -> None:
        self.limit = limit
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, domain: str | None) -> str:
        if domain is None:
            return "none"
        with self._lock:
            if domain in self._seen:
                return domain
            if len(self._seen) < self.limit:
                self._seen.add(domain)
                return domain
        return "other"


class _CorrectionLogCollector:
    """The correction-log writer's counters, read at scrape time (one consistent snapshot)."""

    def __init__(self, writer) -> None:
        self.writer = writer

    def collect(self):
        counts = self.writer.counters()
        for key, doc in (
            ("written", "Correction records Redis acknowledged."),
            (
                "dropped",
                "Correction records dropped: queue full while Redis was away, invalid, or unflushed at shutdown.",
            ),
            ("submitted", "Correction records submitted by finished requests."),
        ):
            yield CounterMetricFamily(f"{PREFIX}correction_log_records_{key}", doc, value=counts[key])
        yield CounterMetricFamily(
            f"{PREFIX}correction_log_errors", "Failed XADD batches (each retried).", value=counts["errors"]
        )
        yield GaugeMetricFamily(
            f"{PREFIX}correction_log_queue_depth", "Correction records waiting for Redis.", value=counts["queue_depth"]
        )


class StatsCollector:
    """Prometheus view of the recorder: the drift alert and the store's own health, read at scrape time.

    `adaptive_spec:drift_alert` is 1 while the served version's first-token acceptance over the
    last window is below the set fraction of its gated figure (service/drift.py)."""

    def __init__(self, recorder) -> None:  # a service.stats_store.StatsRecorder
        self.recorder = recorder

    def collect(self):
        state, counts, name = self.recorder.drift_state, self.recorder.counts, PREFIX
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


def _version_number(version: str | None) -> float:
    if version is None:
        return 0.0
    try:
        return float(version)
    except ValueError:
        return -1.0
