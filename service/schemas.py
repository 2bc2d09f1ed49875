"""Request bodies of the OpenAI-compatible routes, validated before anything is queued.

Supported OpenAI fields: `model`, `messages` (chat) or `prompt` (completions: a string, or a
list of token ids as OpenAI allows; a batch of one is unwrapped), `max_tokens` and its newer
name `max_completion_tokens`, `temperature` in [0, 2] (default 1, as OpenAI; 0 is greedy),
`top_p` in (0, 1], `seed`, `stop` (a string or up to 16, each at most 256 characters), `stream`,
`stream_options.include_usage`, `n` (1 to 8 choices), `user` (ignored), and:

- `response_format`: `{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema",
  "json_schema": {"name": "...", "schema": {...}}}`, enforced by a grammar on every token
  (adaptive_spec/outputs/grammar.py); a schema the grammar library cannot enforce is a 400 with its message;
- `frequency_penalty` and `presence_penalty` in [-2, 2], and `logit_bias` (token id as a string ->
  bias in [-100, 100], at most 300 of them), with OpenAI's formulas (adaptive_spec/outputs/constraints.py);
- log-probabilities, the target's own: chat takes `logprobs: true` and `top_logprobs` in [0, 20];
  completions take the legacy `logprobs` in [0, 5] (the number of alternatives per token).

- tool calling on chat: `tools`, `tool_choice`, `parallel_tool_calls`, and `tool_calls` and `tool`
  messages in the history (ChatRequest; service/tool_calls.py).

Fields OpenAI defines that this server cannot honour (`functions`, `echo`, `best_of`, ...) are
refused with a 400 rather than ignored; unknown fields are ignored.

Extensions:

- `top_k` (an integer; 0 or -1 disables it), as vLLM accepts it.
- `repetition_penalty` in [0.01, 10] (1 = off), as vLLM and transformers: the logit of a token already
  in the prompt or the output is divided by it when positive and multiplied by it when negative.
  A tinier one would divide logits to infinity.
- `adaptive_spec: {"log": false, "domain": "sql"}`:
  - `log: false` opts the request out of the correction log: no record of its prompt or output
    is written anywhere, and nothing of it reaches Redis (not even the dashboard's counters,
    which hold its domain tag). The server's own Prometheus counters, in memory, still count it.
  - `domain` tags the request's correction record and its metrics (the `domain` label). It is
    1-64 characters of letters, digits, `_` and inner `-` (adaptive_spec/contracts.py `check_domain`,
    the rule the registry's aliases follow): `sql.v2` is a 400, never silently the general adapter.
  - `speculative: false` decodes with the target alone, through the same code: the baseline
    that speed figures are divided by (the dashboard's speedup, time to first token). The
    output is the same either way under greedy decoding; only the speed differs.
  The options are a body field only, not headers, so a proxy cannot add or strip them unseen.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from adaptive_spec.contracts import DOMAIN_TAG_PATTERN, MAX_DOMAIN_CHARS
from adaptive_spec.decoding.requests import MAX_LOGPROBS, MAX_N
from adaptive_spec.outputs.constraints import MIN_REPETITION_PENALTY
from adaptive_spec.outputs.tokens import CHAT_ROLES
from adaptive_spec.sample.sampling import SEED_MAX, SEED_MIN

MAX_STOPS = 16
MAX_STOP_CHARS = 256  # each one is searched for in the text of every step: bounded like the prompt
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit
MAX_LOGIT_BIAS = 300  # entries of logit_bias; each is a row of the bias vector
TOKEN_ID = "^[0-9]{1,9}$"  # a logit_bias key
FUNCTION_NAME = "^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for a tool's function name
MAX_TOOLS = 128  # OpenAI's limit on `tools`

# OpenAI fields this server does not implement, and the values that mean "not used".
_UNSUPPORTED = {
    "tools": (None, []),
    "functions": (None, []),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
}

Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]


class AdaptiveSpecOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    log: StrictBool = True
    domain: str | None = Field(None, pattern=DOMAIN_TAG_PATTERN, max_length=MAX_DOMAIN_CHARS)  # contracts.check_domain
    speculative: StrictBool = True


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class JsonSchema(BaseModel):
    """OpenAI's `response_format.json_schema`; `strict` is accepted, and every schema is enforced."""

    model_config = ConfigDict(populate_by_name=True)

    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a json_schema object: {"name": ..., "schema": {...}}')
        return self

    def for_engine(self) -> dict | None:
        """The dict Engine.request takes; None for free text."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        return {
            "type": "json_schema",
            "json_schema": {"name": self.json_schema.name, "schema": self.json_schema.schema_},
        }


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=-1)
    seed: StrictInt | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = Field(None, ge=1, le=MAX_N)
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=10.0)
    logit_bias: dict[str, Bias] | None = Field(None, json_schema_extra={"propertyNames": {"pattern": TOKEN_ID}})
    response_format: ResponseFormat | None = None
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
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string is at most {MAX_STOP_CHARS} characters")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias):
        """Keys are token ids written as strings, as OpenAI's: {"50256": -100}."""
        if bias is None:
            return None
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
        for key in bias:
            if not re.fullmatch(TOKEN_ID, key):
                raise ValueError(f"keys must be token ids (strings of digits), got {key!r}")
        return bias

    @model_validator(mode="after")
    def _supported(self):
        for name, value in (self.model_extra or {}).items():
            if name in _UNSUPPORTED and value not in _UNSUPPORTED[name]:
                raise ValueError(f"{name} is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    def engine_params(self, max_new_tokens: int) -> dict[str, Any]:
        """Keyword arguments for Engine.request."""
        return {
            "max_new_tokens": max_new_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": max(0, self.top_k or 0),
            "seed": self.seed,
            "stop": self.stop or None,
            "speculative": self.adaptive_spec.speculative,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "presence_penalty": self.presence_penalty or 0.0,
            "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
            "logit_bias": {int(token): bias for token, bias in (self.logit_bias or {}).items()} or None,
            "response_format": None if self.response_format is None else self.response_format.for_engine(),
            "logprobs": self.engine_logprobs,
        }

    @property
    def engine_logprobs(self) -> int | None:
        """None: no log-probabilities; n: each token's and its n most likely alternatives."""
        raise NotImplementedError

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    name: str = Field(min_length=1, max_length=64)
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(BaseModel):
    """A call in an assistant message of the history."""

    id: str = Field(min_length=1, max_length=128)
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    role: Literal[CHAT_ROLES]  # type: ignore[valid-type]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = Field(None, min_length=1, max_length=128)  # a tool turn: the call it answers

    @model_validator(mode="after")
    def _shape(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role} ones")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required, except in an assistant message with tool_calls")
        return self

    def as_engine(self) -> dict[str, Any]:
        if self.content is None or isinstance(self.content, str):
            text = self.content
        else:
            text = "".join(part.text for part in self.content)
        message: dict[str, Any] = {"role": self.role, "content": text}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            message["name"] = self.name
        return message


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object; None: no arguments
    strict: StrictBool | None = None  # accepted; a forced call always matches its schema

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, parameters):
        if parameters is not None and parameters.get("type", "object") != "object":
            raise ValueError("a function's parameters must be a JSON schema of an object")
        return parameters


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class ChatRequest(_GenerationRequest):
    """Chat adds `logprobs`/`top_logprobs` and tool calling: `tools` (functions only, up to 128),
    `tool_choice` (`none`, `auto`, `required` or `{"type": "function", "function": {"name": ...}}`;
    `auto` when tools are given, as OpenAI), `parallel_tool_calls` (default true), and assistant
    `tool_calls` and `tool` messages in the history (service/tool_calls.py)."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None

    @model_validator(mode="after")
    def _logprobs_asked(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _tools(self):
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: two functions have the same name")
        if self.tool_choice is not None and self.tool_choice != "none" and not names:
            raise ValueError("tool_choice is only allowed when tools are specified")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(
                f"tool_choice names the function {self.tool_choice.function.name!r}, which is not in tools"
            )
        if self.forces_a_call and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("a forced tool call (tool_choice required or a function) cannot take a response_format")
        called: set[str] = set()
        for i, message in enumerate(self.messages):
            called.update(call.id for call in message.tool_calls or [])
            if message.role == "tool" and message.tool_call_id not in called:
                raise ValueError(
                    f"messages[{i}] answers tool_call_id {message.tool_call_id!r}, which no earlier assistant message called"
                )
        return self

    @property
    def forces_a_call(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_GenerationRequest):
    prompt: Any
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)

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

    @property
    def engine_logprobs(self) -> int | None:
        return self.logprobs
