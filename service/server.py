"""Run the HTTP service with uvicorn until SIGINT or SIGTERM.

    python -m service.server                              # settings from ADAPTIVE_SPEC_*, REDIS_URL
    ADAPTIVE_SPEC_PORT=8001 ADAPTIVE_SPEC_DRAFT=ngram python -m service.server

On a signal uvicorn stops accepting connections and waits up to `drain_timeout_s` for the
requests in flight; then the lifespan drains the engine queue and closes the correction-log
writer (service/runtime.py).
"""

from __future__ import annotations

import logging
import signal
import threading

import uvicorn

from service.app import create_app
from service.settings import Settings

log = logging.getLogger(__name__)


def run(settings: Settings, engine=None) -> None:
    """Serve on settings.host:settings.port; returns after a graceful shutdown (exit status 0)."""
    for warning in settings.warnings():  # what the configuration leaves open, said before anything loads
        log.warning(warning)
    config = uvicorn.Config(
        create_app(settings, engine),
        host=settings.host,
        port=settings.port,
        timeout_graceful_shutdown=settings.drain_timeout_s,
        log_level="info",
    )
    # uvicorn handles SIGINT/SIGTERM while it serves, then raises the signal again for the handler
    # it found. The shutdown is done by then: that second delivery must not kill the process (with
    # Python's default) or unwind it as an error (with the CLI's), so it is a no-op here.
    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, _after_shutdown) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        uvicorn.Server(config).run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _after_shutdown(signum, frame) -> None:
    """The signal uvicorn re-raises after its graceful shutdown: nothing left to do."""


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run(Settings.from_env())
