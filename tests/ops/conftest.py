"""The ops tests reuse the service tests' live server and tiny engine (tests/service/conftest.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "_service_conftest", Path(__file__).resolve().parents[1] / "service" / "conftest.py"
)
_service = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_service)

tiny_engine = _service.tiny_engine
live_server = _service.live_server
