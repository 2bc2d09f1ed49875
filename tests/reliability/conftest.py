"""Fixtures for the fault, fuzz, load and security tests (helpers in support.py).

with serve_process(env={"REDIS_URL": redis_server.url}) as server:   # `adaptive-spec serve` as a child
    ...
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from support import ServeProcess

# `tiny_model_dir` (the tiny Llama and chat tokenizer saved once per session) is in tests/conftest.py.


@pytest.fixture
def serve_process(tmp_path, tiny_model_dir):
    @contextmanager
    def serve(env: dict[str, str] | None = None, args: list[str] = ()) -> Iterator[ServeProcess]:
        server = ServeProcess(tmp_path, tiny_model_dir, env or {}, list(args))
        server.start()
        try:
            yield server
        finally:
            server.stop()

    return serve
