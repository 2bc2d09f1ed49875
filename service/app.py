"""The FastAPI app: OpenAI-compatible generation, health and metrics over one speculative engine.

    adaptive-spec serve --port 8000                  # the command line (service/server.py `run`)
    ADAPTIVE_SPEC_DRAFT=ngram python -m service.server  # no draft model: the lightest CPU variant
    app = create_app(Settings.from_env(), engine)    # in code, e.g. tests with a tiny engine

Importing this module loads no weights: the engine is built in the lifespan (STYLE.md §14), or
passed in, as the tests do with a tiny model. Routes live in `service/routers/`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from service import errors
from service.body_limit import BodyLimit
from service.routers import admin, dashboard, openai, ops
from service.runtime import Service
from service.settings import Settings

log = logging.getLogger(__name__)


def create_app(settings: Settings | None = None, engine=None) -> FastAPI:
    """The app. `engine` (an `adaptive_spec.Engine`) skips loading models from `settings`."""
    settings = settings or Settings.from_env()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.service = await _started(app, settings, engine)
        try:
            yield
        finally:
            if app.state.service is not None:
                await run_in_threadpool(app.state.service.stop)

    app = FastAPI(
        title="adaptive-spec",
        summary="Lossless speculative decoding with a draft that keeps learning.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.service = None
    app.state.stop_requested = lambda: False  # service/server.py: whether a signal asked uvicorn to stop
    app.state.stopped_while_loading = False
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    errors.install(app)
    app.include_router(openai.router)
    app.include_router(ops.router)
    app.include_router(admin.router)
    dashboard.install(app)
    return app


async def _started(app: FastAPI, settings: Settings, engine) -> Service | None:
    """`Service.start` (loading the models: minutes while the step first compiles), or None when a signal
    asks the server to stop before it is done (`app.state.stopped_while_loading` then says so).

    The load runs in a daemon thread and is polled, so a SIGTERM or Ctrl-C during it is acted on now, not
    after the compile. The loading itself cannot be stopped (torch's work on the engine thread); whoever
    started the server ends the process without waiting for it (service/server.py `StoppedWhileLoading`).
    A load that ends after the server gave up on it stops the service it started."""
    loading: Future = Future()
    verdict = threading.Lock()  # the load's end and the decision to give up on it, one before the other

    def load() -> None:
        try:
            service = Service.start(settings, engine)
        except BaseException as exc:  # handed to the lifespan, which fails the startup with it as before
            loading.set_exception(exc)
            return
        with verdict:
            abandoned = app.state.stopped_while_loading
            if not abandoned:
                loading.set_result(service)
        if abandoned:
            service.stop()

    threading.Thread(target=load, name="service-start", daemon=True).start()
    waiting = asyncio.wrap_future(loading)
    while True:
        with verdict:
            if loading.done():
                return loading.result()
            if app.state.stop_requested():
                app.state.stopped_while_loading = True
                log.warning("asked to stop while the models were loading: not serving")
                return None
        await asyncio.wait({waiting}, timeout=0.2)
