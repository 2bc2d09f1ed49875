"""JSON has no NaN or infinity: figures that may hold them (a gate over zero positions, a chain step
never reached) pass through `finite` before they are written or served."""

from __future__ import annotations

import math


def finite(value):
    """`value` with every NaN and infinity, at any depth of dicts, lists and tuples, as None (null)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite(item) for item in value]
    return value
