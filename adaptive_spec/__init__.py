"""adaptive-spec: lossless speculative decoding whose draft keeps learning from live traffic.

from adaptive_spec import Engine
engine = Engine.from_pretrained(target="smollm2-135m-instruct", draft="early-exit:4")
out = engine.generate("Write a haiku about rivers.", max_new_tokens=64)
"""

from adaptive_spec.engine import Chunk, Engine, GenerationOutput, InputError
from adaptive_spec.sampling import SamplingParams

__all__ = ["Chunk", "Engine", "GenerationOutput", "InputError", "SamplingParams"]
