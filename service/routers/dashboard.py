"""The ops dashboard: the page (`GET /dashboard`, assets from `service/static/dashboard/`, package data that
every install carries) and its JSON API.

    open http://127.0.0.1:8000/dashboard
    curl -s 'localhost:8000/api/stats/series?from=1700000000&to=1700003600'   # step chosen by range
    curl -s 'localhost:8000/api/stats/series?from=1700000000&to=1700086400&step=600'
    curl -s 'localhost:8000/api/stats/events?from=1700000000'                 # swap / rollback markers
    curl -s 'localhost:8000/api/stats/summary'                                # champion, trainer, domains, drift

Times are unix seconds; `to` defaults to now and `from` to an hour before `to`. Without `step`
the finest stored buckets that give at most `MAX_POINTS` points are used (24 h -> 60 s buckets,
1440 points), so the page stays fast whatever the range. A given `step` is read from the coarsest
buckets that make it up, only where retention still keeps them, and a request reading more than
`MAX_BUCKETS` (12,000) bucket hashes is a 400 `too_many_buckets` that names a step to use. Reads run on
two threads of their own, never on the pool that admits /v1 requests. The figures and their formulas are in
`service/stats_queries.py`. Like /metrics, these routes need no key and show no request content.
Without REDIS_URL there is no store: the API answers 503 and the page says why.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated

import redis
from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from service.errors import APIError, bad_request
from service.finite import finite
from service.stats_queries import MAX_POINTS, RESOLUTIONS, TARGET_ALONE, figures
from service.stats_store import StatsRecorder

ASSETS = Path(__file__).resolve().parents[1] / "static" / "dashboard"  # package data (pyproject.toml)
MAX_RANGE_S = 31 * 86400
DEFAULT_RANGE_S = 3600

router = APIRouter(tags=["dashboard"])

From = Annotated[float | None, Query(alias="from", description="unix seconds; default: `to` - 1 h")]
To = Annotated[float | None, Query(alias="to", description="unix seconds; default: now")]


def install(app: FastAPI) -> None:
    """The routes, and the page's assets under /dashboard/static."""
    app.include_router(router)
    app.mount("/dashboard/static", StaticFiles(directory=ASSETS, check_dir=False), name="dashboard-static")


@router.get("/dashboard", include_in_schema=False)
async def page() -> FileResponse:
    index = ASSETS / "index.html"
    if not index.is_file():
        raise APIError(
            404,
            f"dashboard assets not found at {ASSETS} (package data of `service`: reinstall adaptive-spec)",
            code="not_found",
        )
    return FileResponse(index, headers={"Cache-Control": "no-cache"})


@router.get("/api/stats/series")
async def series(
    request: Request,
    start: From = None,
    end: To = None,
    step: Annotated[int | None, Query(description="seconds, a multiple of 10")] = None,
) -> JSONResponse:
    """Acceptance rate, mean acceptance length, first-token acceptance, tokens/s, speedup (where
    the same buckets hold target-alone requests) and requests, by adapter version and by domain."""
    stats = _store(request)
    start, end = _range(start, end)
    if step is not None and (step < RESOLUTIONS[0] or step % RESOLUTIONS[0]):
        raise bad_request(f"step must be a positive multiple of {RESOLUTIONS[0]} seconds, got {step}", "step")
    if step is not None and (end - start) / step > MAX_POINTS:
        raise bad_request(
            f"step {step} s over {end - start:.0f} s gives more than {MAX_POINTS} points",
            "step",
            code="too_many_points",
        )
    try:
        stats.resolution_for(start, end, step)  # what it would read, counted before anything is read
    except ValueError as exc:
        raise bad_request(str(exc), "step", code="too_many_buckets") from None
    return _json(await _read(stats.series, start, end, step))


@router.get("/api/stats/events")
async def events(request: Request, start: From = None, end: To = None) -> JSONResponse:
    """Swap and rollback markers: [{t, kind, version, by, replicas}], oldest first."""
    stats = _store(request)
    start, end = _range(start, end)
    return _json({"from": start, "to": end, "events": await _read(stats.events, start, end)})


@router.get("/api/stats/summary")
async def summary(request: Request, start: From = None, end: To = None) -> JSONResponse:
    """The served version with its gate figures, the drift alert, and per-domain and per-version
    figures over the range."""
    stats = _store(request)
    start, end = _range(start, end)
    service = request.app.state.service
    return _json(await _read(_summary, stats, service, start, end))


def _summary(stats: StatsRecorder, service, start: float, end: float) -> dict:
    served = service.engine.adapter_version
    held = service.engine.adapters.versions()  # domain (None: general) -> version this server drafts with
    drift = stats.drift(served)
    stats.drift_state = drift  # the gauge follows what the page shows
    by_version: dict[str, dict[str, float]] = {}
    by_domain: dict[str, dict[str, float]] = {}
    baseline_by_domain: dict[str, dict[str, float]] = {}
    for (version, domain), sums in stats.totals(start, end).items():
        _add(by_version.setdefault(version, {}), sums)
        _add((baseline_by_domain if version == TARGET_ALONE else by_domain).setdefault(domain, {}), sums)
    baseline = by_version.get(TARGET_ALONE)
    settings = stats.drift_settings
    return {
        "now": time.time(),
        "from": start,
        "to": end,
        "replica": stats.replica,
        "served_version": served,
        "decoding": _decoding(service.engine),  # dtype and path serving, and whether it is exact here
        "champion": stats.adapter_info(served) if served is not None else None,
        "trainer": stats.trainer_status(),  # what the trainer did last or waits for (trainer/loop/rounds.py)
        "drift": {
            **drift.as_dict(),
            "window_s": settings.window_s,
            "fraction": settings.fraction,
            "min_drafts": settings.min_drafts,
        },
        "versions": [{"version": v, **figures(s, baseline)} for v, s in sorted(by_version.items())],
        "domains": [
            {"domain": d, "adapter": _drafts_with(held, d), **figures(s, baseline_by_domain.get(d))}
            for d, s in sorted(by_domain.items())
        ],
        "store": dict(stats.counts),
    }


def _drafts_with(held: dict, label: str) -> str | None:
    """The version a domain's requests draft with now: its own adapter, else the general one (None: the
    base draft). `label` is the stats' ("none": untagged, "other": past the label limit)."""
    return held.get(label, held.get(None)) if label not in ("none", "other") else held.get(None)


def _add(into: dict[str, float], sums: dict[str, float]) -> None:
    for name, value in sums.items():
        into[name] = into.get(name, 0.0) + value


def _store(request: Request) -> StatsRecorder:
    service = getattr(request.app.state, "service", None)
    if service is None:
        raise APIError(503, "the server is starting", code="unavailable")
    if service.stats is None:
        raise APIError(
            503, "the dashboard needs Redis: set REDIS_URL (adaptive-spec up starts one)", code="stats_unavailable"
        )
    return service.stats


MAX_UNIX_S = 253_402_300_800  # year 10000: later times overflow Redis stream ids (ms, 64 bits) -> 400, not 503


def _range(start: float | None, end: float | None) -> tuple[float, float]:
    end = time.time() if end is None else end
    start = end - DEFAULT_RANGE_S if start is None else start
    for name, value in (("from", start), ("to", end)):
        if not math.isfinite(value) or not 0 <= value < MAX_UNIX_S:
            raise bad_request(f"{name} must be a unix time in seconds, got {value}", name)
    if start >= end:
        raise bad_request(f"from ({start:.0f}) must be before to ({end:.0f})", "from")
    if end - start > MAX_RANGE_S:
        raise bad_request(
            f"the range is at most {MAX_RANGE_S // 86400} days, got {(end - start) / 86400:.1f}",
            "from",
            code="range_too_long",
        )
    return start, end


_READS = ThreadPoolExecutor(2, thread_name_prefix="stats-read")  # never the pool /v1 admission runs on


async def _read(function, *args):
    """`function(*args)` on the dashboard's own two threads: a burst of costly reads waits for them, while the
    pool that checks and tokenises /v1 requests stays free."""
    try:
        return await asyncio.get_running_loop().run_in_executor(_READS, functools.partial(function, *args))
    except (redis.RedisError, OSError) as exc:
        raise APIError(
            503, f"the stats store (Redis) is unavailable: {type(exc).__name__}", code="stats_unavailable"
        ) from None


def _json(body) -> JSONResponse:
    return JSONResponse(finite(body), headers={"Cache-Control": "no-store"})


def _decoding(engine) -> dict:
    """{"dtype": "bf16", "path": "compiled", "exact": True}: what decodes, as /health says it."""
    return {
        "dtype": engine.dtype_name,
        "path": engine.path,
        "exact": engine.exactness.exact if engine.exactness_known else None,
    }
