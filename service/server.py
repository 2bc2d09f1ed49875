"""Run the HTTP service with uvicorn until SIGINT or SIGTERM.

    python -m service.server                              # settings from ADAPTIVE_SPEC_*, REDIS_URL
    ADAPTIVE_SPEC_PORT=8001 ADAPTIVE_SPEC_DRAFT=ngram python -m service.server

On a signal uvicorn stops accepting connections and waits up to `drain_timeout_s` for the
requests in flight; then the lifespan drains the engine queue and closes the correction-log
writer (service/runtime.py). A signal while the models still load (minutes while the step first
compiles) stops the server at once: `run` raises `StoppedWhileLoading`, and the command ends the
process with `exit_now` once its own cleanup is done, without waiting for the load.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import NoReturn

import uvicorn

from service.app import create_app
from service.settings import Settings

log = logging.getLogger(__name__)


def run(settings: Settings, engine=None) -> None:
    """Serve on settings.host:settings.port; returns after a graceful shutdown (exit status 0). Raises
    `StoppedWhileLoading` when a signal came while the models were loading."""
    for warning in settings.warnings():  # what the configuration leaves open, said before anything loads
        log.warning(warning)
    app = create_app(settings, engine)
    config = uvicorn.Config(
        app,
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
    server = uvicorn.Server(config)
    app.state.stop_requested = lambda: server.should_exit  # the lifespan stops waiting for the load
    try:
        server.run()
    except SystemExit:  # uvicorn exits when it cannot bind the port, which it tries even after giving up the load
        if not app.state.stopped_while_loading:
            raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if app.state.stopped_while_loading:
        raise StoppedWhileLoading("stopped while the models were loading: nothing was served")


class StoppedWhileLoading(Exception):
    """A signal came while the models were loading. The server never served; the thread loading them
    cannot be stopped and Python would wait for it at exit (minutes, while the step compiles), so the
    command ends the process with `exit_now` after its own cleanup (`up` stops Redis first)."""


def exit_now(code: int, message: str) -> NoReturn:
    """Say `message`, then end the process at once: no waiting for threads still at work (a model
    loading). What was logged or printed is flushed first."""
    print(f"adaptive-spec: {message}", file=sys.stderr)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _after_shutdown(signum, frame) -> None:
    """The signal uvicorn re-raises after its graceful shutdown: nothing left to do."""


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run(Settings.from_env())
    except StoppedWhileLoading as exc:
        exit_now(0, str(exc))
