"""Operations routes: /health (readiness) and /metrics (Prometheus).

    curl -s localhost:8000/health     # 200 {"status": "ok", ...}; 503 while starting or draining
    curl -s localhost:8000/metrics    # adaptive_spec:spec_decode_* and friends (service/metrics.py)

Neither needs the API key, so probes and scrapers work on a locked-down server; neither shows
any request content.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from service.errors import APIError

router = APIRouter(tags=["ops"])


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    service = getattr(request.app.state, "service", None)
    if service is None:
        return JSONResponse({"status": "starting"}, status_code=503)
    engine, worker = service.engine, service.worker
    body = {
        "status": "draining" if worker.closing else "ok",
        "model": service.model_name,
        "draft": engine.draft_id,
        "adapter_version": engine.adapter_version,
        "requests_running": worker.running,
        "requests_waiting": worker.waiting,
        "correction_log": service.writer.counters() if service.writer is not None else None,
    }
    return JSONResponse(body, status_code=503 if worker.closing else 200)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    service = getattr(request.app.state, "service", None)
    if service is None:
        raise APIError(503, "the server is starting", code="unavailable")
    return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)
