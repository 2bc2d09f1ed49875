"""Run the HTTP service with uvicorn until SIGINT or SIGTERM.

    python -m service.server                              # settings from ADAPTIVE_SPEC_*, REDIS_URL
    ADAPTIVE_SPEC_PORT=8001 ADAPTIVE_SPEC_DRAFT=ngram python -m service.server

On a signal uvicorn stops accepting connections and waits up to `drain_timeout_s` for the
requests in flight; then the lifespan drains the engine queue and closes the correction-log
writer (service/runtime.py).
"""

from __future__ import annotations

import logging

import uvicorn

from service.app import create_app
from service.settings import Settings


def run(settings: Settings, engine=None) -> None:
    """Serve on settings.host:settings.port; returns after a graceful shutdown."""
    config = uvicorn.Config(create_app(settings, engine), host=settings.host, port=settings.port,
                            timeout_graceful_shutdown=settings.drain_timeout_s, log_level="info")
    uvicorn.Server(config).run()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run(Settings.from_env())
