"""Waiting in tests for what a background thread or another process does.

from polling import wait_for     # tests/helpers is on the path (pyproject.toml: pythonpath)
version = wait_for(lambda: engine.adapter_version, 10, "the swap")
"""

from __future__ import annotations

import time


def wait_for(condition, timeout: float = 10.0, what: str = "the condition", interval: float = 0.05):
    """Poll `condition` until it returns something truthy, and return that; fail the test after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
