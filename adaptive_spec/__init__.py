"""adaptive-spec: lossless speculative decoding whose draft keeps learning from live traffic.

from adaptive_spec import Engine
engine = Engine.from_pretrained(target="smollm2-135m-instruct", draft="head")
out = engine.generate("Write a haiku about rivers.", max_new_tokens=64)

The names below are imported on first use, so `adaptive_spec.contracts` and the other light modules
(what `adaptive-spec adapters ...` and `--help` need) do not pull torch and transformers in.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from adaptive_spec.engine import Chunk, Engine, GenerationOutput, InputError
    from adaptive_spec.sample.sampling import SamplingParams

_HOMES = {
    "Chunk": "adaptive_spec.engine",
    "Engine": "adaptive_spec.engine",
    "GenerationOutput": "adaptive_spec.engine",
    "InputError": "adaptive_spec.engine",
    "SamplingParams": "adaptive_spec.sample.sampling",
}
__all__ = ["Chunk", "Engine", "GenerationOutput", "InputError", "SamplingParams"]  # the keys of _HOMES


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'adaptive_spec' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
