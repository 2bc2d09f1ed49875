"""Fixtures for the HTTP service tests: tiny engines and live uvicorn servers on loopback.

with live_server(tiny_engine, queue_size=1) as server:   # Settings fields as keywords
    httpx.post(server.url + "/v1/completions", json={...})
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import uvicorn
from tiny import tiny_target
from tiny_chat import tiny_tokenizer

from adaptive_spec import Engine
from launch.processes import free_port
from service.app import create_app
from service.settings import Settings


class LiveServer:
    """uvicorn serving `create_app(settings, engine)` in a thread, on a free loopback port."""

    def __init__(self, settings: Settings, engine: Engine) -> None:
        self.app = create_app(settings, engine)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)

    @property
    def service(self):
        return self.app.state.service

    def start(self, timeout: float = 120.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on port {self.port}")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="session")
def tiny_engine() -> Engine:
    """Token ids only (no tokenizer), as the engine tests use it; records the target's top-8. A fixed
    k = 3 makes every step draft, where dynamic k would soon stop drafting with a random draft."""
    return Engine(tiny_target(0), "early-exit:1", tokenizer=None, k=3, record_topk=8)


@pytest.fixture(scope="session")
def chat_engine() -> Engine:
    """The same tiny target with a character-level chat tokenizer: chat, text and stop strings."""
    return Engine(tiny_target(0), "early-exit:1", tokenizer=tiny_tokenizer(), target_id="tiny-chat", record_topk=8)


@pytest.fixture(scope="session")
def live_server():
    @contextmanager
    def serve(engine: Engine | None, **settings) -> Iterator[LiveServer]:
        """engine None: the app's lifespan loads the models the settings name."""
        server = LiveServer(Settings(**{"max_tokens_limit": 200, "request_timeout_s": 60.0, **settings}), engine)
        server.start()
        try:
            yield server
        finally:
            server.stop()

    return serve
