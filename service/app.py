"""The FastAPI app: OpenAI-compatible generation, health and metrics over one speculative engine.

    adaptive-spec serve --port 8000                  # the command line (service/server.py `run`)
    ADAPTIVE_SPEC_DRAFT=ngram python -m service.server  # no draft model: the lightest CPU variant
    app = create_app(Settings.from_env(), engine)    # in code, e.g. tests with a tiny engine

Importing this module loads no weights: the engine is built in the lifespan (STYLE.md §14), or
passed in, as the tests do with a tiny model. Routes live in `service/routers/`.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from service import errors
from service.body_limit import BodyLimit
from service.routers import admin, dashboard, openai, ops
from service.runtime import Service
from service.settings import Settings


def create_app(settings: Settings | None = None, engine=None) -> FastAPI:
    """The app. `engine` (an `adaptive_spec.Engine`) skips loading models from `settings`."""
    settings = settings or Settings.from_env()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.service = await run_in_threadpool(Service.start, settings, engine)
        try:
            yield
        finally:
            await run_in_threadpool(app.state.service.stop)

    app = FastAPI(
        title="adaptive-spec",
        summary="Lossless speculative decoding with a draft that keeps learning.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.service = None
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    errors.install(app)
    app.include_router(openai.router)
    app.include_router(ops.router)
    app.include_router(admin.router)
    dashboard.install(app)
    return app
