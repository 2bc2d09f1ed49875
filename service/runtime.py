"""What the app holds while it runs: the engine, its worker thread, the metrics and the
correction-log writer, started in the app's lifespan and stopped in order at shutdown.

Shutdown order (DESIGN.md "Behaviour under faults"): stop accepting (new requests get 503),
let the queued and running requests finish for up to `drain_timeout_s`, then close the writer,
which flushes what Redis accepts within a few seconds and counts the rest as dropped.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid

from adaptive_spec.decoding.request import Request
from adaptive_spec.engine import Engine, GenerationOutput
from adaptive_spec.formats.adapters import AdapterDir
from registry.client import AdapterRegistry
from service.correction_log import CorrectionLogWriter
from service.drift import DriftSettings
from service.metrics import ServiceMetrics, StatsCollector
from service.settings import Settings
from service.stats_store import StatsRecorder
from service.watcher import open_registry, start_watcher
from service.worker import EngineWorker, Job, engine_thread

log = logging.getLogger(__name__)


class Service:
    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        writer: CorrectionLogWriter | None,
        stats: StatsRecorder | None = None,
        registry: AdapterRegistry | None = None,
        thread=None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.writer = writer
        self.stats = stats  # the dashboard store (service/stats_store.py); None without Redis
        self.model_name = settings.served_model_name or engine.target_id
        self.registry = registry  # the adapter registry when one is configured (service/watcher.py open_registry)
        self.watcher = None  # follows the registry's champion alias and hot-swaps the adapter
        self.started_at = int(time.time())
        self.worker = EngineWorker(
            engine, settings.queue_size, settings.max_batch, on_end=self.request_ended, thread=thread
        )
        self.metrics = ServiceMetrics(engine, self.worker, writer)
        self.worker.on_step = self.metrics.observe_step
        if stats is not None:
            self.metrics.registry.register(StatsCollector(stats))
        self._warned_no_topk = False

    @classmethod
    def start(cls, settings: Settings, engine: Engine | None = None) -> Service:
        """Load the models (unless an engine is given), start the writer and the worker. Blocking.

        The models load on the thread that will decode with them (worker.py says why)."""
        thread = engine_thread()
        try:
            if engine is None:
                log.info("loading %s with draft %s", settings.target, settings.draft)
                engine = thread.submit(
                    Engine.from_pretrained,
                    settings.target,
                    settings.draft,
                    device=settings.device,
                    dtype=settings.dtype,
                    k=settings.k,
                    compile=settings.compile,
                    tree_budget=settings.tree_budget,
                    record_topk=settings.record_topk,
                    max_adapters=settings.max_adapters,
                    json_whitespace=settings.json_whitespace,
                ).result()
            report = thread.submit(lambda: engine.exactness).result()  # /health and the dashboard say it
            level = logging.INFO if report.exact else logging.WARNING
            log.log(level, "decoding %s %s: %s", engine.dtype_name, engine.path, report.summary())
            if settings.adapter:  # served from the start, until the registry's champion says otherwise
                thread.submit(engine.load_adapter, settings.adapter).result()
                log.info("serving adapter %s from %s", engine.adapter_version, settings.adapter)
        except BaseException:
            thread.shutdown(wait=False)
            raise
        writer = stats = None
        if settings.redis_url:
            writer = CorrectionLogWriter(
                settings.redis_url,
                maxlen=settings.stream_maxlen,
                queue_size=settings.log_queue_size,
                max_bytes=settings.stream_max_bytes,
            )
            drift = DriftSettings(settings.drift_window_s, settings.drift_fraction, settings.drift_min_drafts)
            stats = StatsRecorder(
                settings.redis_url,
                retention_s=settings.stats_retention_s,
                drift=drift,
                served_version=lambda: engine.adapter_version,
            ).start()
            if settings.adapter:  # served from the start: its gate figures for the summary, not a swap
                stats.adapter_loaded(engine.adapter_version, AdapterDir(settings.adapter).metadata())
        service = cls(settings, engine, writer, stats, open_registry(settings), thread)
        service.worker.start()
        service.watcher = start_watcher(
            engine, service.registry, settings, metrics=service.metrics, on_swap=service.record_swap
        )
        log.info("serving %s (draft %s) with %r", service.model_name, engine.draft_id, settings)
        return service

    def stop(self) -> None:
        """Drain, then stop the writer. Blocking; called once from the lifespan."""
        if self.watcher is not None:
            self.watcher.stop()
        self.worker.close(self.settings.drain_timeout_s)
        if self.writer is not None:
            self.writer.close(timeout=5.0)
        if self.stats is not None:
            self.stats.close()
        log.info("stopped; correction log %s", self.writer.counters() if self.writer else "off")

    def record_swap(
        self, kind: str, version: str | None, by: str | None, adapter_dir, *, domain: str | None = None
    ) -> None:
        """The watcher's callback, once per swap it made (of the general adapter, or of `domain`'s): a
        dashboard marker with the adapter's gate figures."""
        if self.stats is not None:
            self.stats.mark(kind, version, by, adapter_dir=adapter_dir, domain=domain)

    def new_job(self, requests: list[Request], *, log_record: bool) -> Job:
        """A job for the worker: one checked request per choice (Engine.requests); its id names the
        response and the correction records (one per choice). Where no record will be written (no
        correction log, or the request opted out), its requests keep no target top-m: a log-softmax and
        a top-m over the vocabulary per row and step, about 3% of a serving engine's time at 4 users
        (py-spy, 2 cores), for nothing."""
        if not (log_record and self.writer is not None):
            requests = [dataclasses.replace(request, record=False) for request in requests]
        return Job(
            requests,
            deadline=time.monotonic() + self.settings.request_timeout_s,
            meta={"request_id": uuid.uuid4().hex, "created": int(time.time()), "log": log_record},
        )

    def request_ended(self, job: Job, output: GenerationOutput | None, index: int = 0) -> None:
        """On the worker thread, after the handler has a choice's last chunk: count it, log its record."""
        if output is None:
            self.metrics.requests_cancelled.labels(job.cancel_reason or "unknown").inc()
            return
        domain = job.requests[0].domain
        self.metrics.observe(
            output.stats,
            domain=domain,
            finish_reason=output.finish_reason,
            prompt_tokens=len(output.prompt_ids),
            generation_tokens=len(output.token_ids),
            latency_s=time.monotonic() - job.arrived,
        )
        if self.stats is not None and job.meta["log"]:  # memory only; a thread writes to Redis. Opted out: no trace
            self.stats.record(
                output.stats,
                domain=domain,
                greedy=job.requests[0].params.greedy,
                speculative=job.requests[0].speculative,
            )
        if self.writer is None or not job.meta["log"]:
            return
        if output.target_topk_ids is None:
            if not self._warned_no_topk:
                log.warning("the engine records no target top-m (record_topk=0): no correction records are written")
                self._warned_no_topk = True
            return
        self.writer.log(  # never blocks on Redis
            output,
            request_id=job.meta["request_id"] if index == 0 else f"{job.meta['request_id']}-{index}",
            domain=domain,
            target_id=self.engine.target_id,
            draft_id=self.engine.draft_id,
            temperature=job.requests[0].params.temperature,
        )
