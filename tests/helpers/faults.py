"""Failures injected where no real input reaches them yet.

fake, passed = fails_after(1, Constraints, "constraints could not be built")
monkeypatch.setattr(batch_module, "Constraints", fake)   # the second call raises
"""

from __future__ import annotations

from collections.abc import Callable


def fails_after(calls: int, real: Callable, message: str) -> tuple[Callable, list[bool]]:
    """A stand-in for `real` that passes its first `calls` calls through to it and raises RuntimeError(message)
    from then on, and the list that gets a True for each call passed through."""
    passed: list[bool] = []

    def fake(*args, **kwargs):
        if len(passed) >= calls:
            raise RuntimeError(message)
        passed.append(True)
        return real(*args, **kwargs)

    return fake, passed
