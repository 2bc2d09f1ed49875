"""Operations routes: /health (readiness and liveness) and /metrics (Prometheus).

    curl -s localhost:8000/health     # 200 {"status": "ok", ...}; 503 while starting or draining, or
                                      # "unhealthy" once a thread that serving needs is dead
    curl -s localhost:8000/metrics    # adaptive_spec:spec_decode_* and friends (service/metrics.py)

Neither needs the API key, so probes and scrapers work on a locked-down server; neither shows
any request content.

`/health` reports each long-lived thread in `threads` (true: running, false: dead, null: this server
has none). None of them dies of an outage: each catches Redis and MLflow errors and retries, so a dead
one is a bug whose effect lasts until the process restarts, and a 503 is how an orchestrator learns to
restart it (the k8s manifest probes /health for readiness and liveness). Two matter to serving:

- `engine`: the thread that decodes. Dead, every request would wait for its timeout (504).
- `adapter_watcher`: what this server serves. Dead, it follows no promotion and, worse, no rollback
  (an operator's way off a bad adapter), and the fleet's replicas drift apart. A restarted server
  loads the champions before it reports ready.

The correction-log writer does not: its death changes no answer and no adapter. Records then queue
and are dropped and counted, exactly as while Redis is away (DESIGN.md: serving goes on), which
`AdaptiveSpecCorrectionLogDropping` (ops/prometheus/alerts.yml) already alerts on. A 503 for it would
take the whole pod of a sidecar out of its Service while the app could serve. It shows as
`"correction_log": false` in `threads`.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from service.errors import APIError

router = APIRouter(tags=["ops"])

SERVING_THREADS = ("engine", "adapter_watcher")  # a dead one makes /health 503 (the module docstring says why)


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    service = getattr(request.app.state, "service", None)
    if service is None:
        return JSONResponse({"status": "starting"}, status_code=503)
    engine, worker = service.engine, service.worker
    threads = {
        "engine": worker.alive,
        "adapter_watcher": service.watcher.alive if service.watcher is not None else None,
        "correction_log": service.writer.alive if service.writer is not None else None,
    }
    dead = [name for name in SERVING_THREADS if threads[name] is False]
    body = {
        "status": "draining" if worker.closing else "unhealthy" if dead else "ok",
        "model": service.model_name,
        "draft": engine.draft_id,
        "dtype": engine.dtype_name,
        "path": engine.path,  # "compiled" or "eager" decoding steps
        "exact": engine.exactness.exact if engine.exactness_known else None,  # batch-invariant on this machine
        "adapter_version": engine.adapter_version,
        # prompts' cached prefixes (adaptive_spec/cache/prefix.py): blocks, bytes, lookups, hits, tokens reused
        "prefix_cache": engine.prefix_cache.stats() if engine.prefix_cache is not None else None,
        "requests_running": worker.running,
        "requests_waiting": worker.waiting,
        "correction_log": service.writer.counters() if service.writer is not None else None,
        "threads": threads,
    }
    if dead:
        body["dead"] = dead
    return JSONResponse(body, status_code=503 if worker.closing or dead else 200)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    service = getattr(request.app.state, "service", None)
    if service is None:
        raise APIError(503, "the server is starting", code="unavailable")
    return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)
