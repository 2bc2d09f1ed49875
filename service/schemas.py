"""Request bodies of the OpenAI-compatible routes, validated before anything is queued.

Supported OpenAI fields: `model`, `messages` (chat) or `prompt` (completions: a string, or a
list of token ids as OpenAI allows; a batch of one is unwrapped), `max_tokens` and its newer
name `max_completion_tokens`, `temperature` in [0, 2] (default 1, as OpenAI; 0 is greedy),
`top_p` in (0, 1], `seed`, `stop` (a string or up to 16), `stream`,
`stream_options.include_usage`, `n` (1 only), `user` (ignored). Fields OpenAI defines that this
server cannot honour (`logprobs`, `tools`, penalties, ...) are refused with a 400 rather than
ignored; unknown fields are ignored.

Extensions:

- `top_k` (an integer; 0 or -1 disables it), as vLLM accepts it.
- `adaptive_spec: {"log": false, "domain": "sql"}`:
  - `log: false` opts the request out of the correction log: no record of its prompt or output
    is written anywhere, and nothing of it reaches Redis (not even the dashboard's counters,
    which hold its domain tag). The server's own Prometheus counters, in memory, still count it.
  - `domain` tags the request's correction record and its metrics (the `domain` label). It is
    1-64 characters of letters, digits and `_.-`.
  - `speculative: false` decodes with the target alone, through the same code: the baseline
    that speed figures are divided by (the dashboard's speedup, time to first token). The
    output is the same either way under greedy decoding; only the speed differs.
  The options are a body field only, not headers, so a proxy cannot add or strip them unseen.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from adaptive_spec.engine import CHAT_ROLES

MAX_STOPS = 16

# OpenAI fields this server does not implement, and the values that mean "not used".
_UNSUPPORTED = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "functions": (None, []),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "response_format": (None, {"type": "text"}),
}


class AdaptiveSpecOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    log: StrictBool = True
    domain: str | None = Field(None, pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    speculative: StrictBool = True


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=-1)
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = None
    user: str | None = None
    adaptive_spec: AdaptiveSpecOptions = Field(default_factory=AdaptiveSpecOptions)

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n):
        if n not in (None, 1):
            raise ValueError("only n=1 is supported")
        return n

    @model_validator(mode="after")
    def _supported(self):
        for name, value in (self.model_extra or {}).items():
            if name in _UNSUPPORTED and value not in _UNSUPPORTED[name]:
                raise ValueError(f"{name} is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    def engine_params(self, max_new_tokens: int) -> dict[str, Any]:
        """Keyword arguments for Engine.stream."""
        return {
            "max_new_tokens": max_new_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": max(0, self.top_k or 0),
            "seed": self.seed,
            "stop": self.stop or None,
            "speculative": self.adaptive_spec.speculative,
        }

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal[CHAT_ROLES]  # type: ignore[valid-type]
    content: str | list[TextPart]
    name: str | None = None

    def as_engine(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": self.role, "content": text}


class ChatRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(_GenerationRequest):
    prompt: Any

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, prompt):
        """A string or a list of token ids; a batch of exactly one of those is unwrapped."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise ValueError("batched prompts are not supported: send one prompt per request")
        raise ValueError("prompt must be a string or a list of token ids")
