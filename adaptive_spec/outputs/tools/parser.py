"""What every tool-call format shares: the functions a request offers, the calls read back, the
deltas a stream sends, and the registry of formats (as vLLM's `--tool-call-parser`).

    parser = tool_parser("hermes")                          # ADAPTIVE_SPEC_TOOL_CALL_PARSER
    content, calls = parser.parse(output_text)             # a whole output
    stream = parser.stream(parallel=True)                  # or piece by piece, as a stream shows it
    delta = stream.push('<tool_call>\\n{"name": "get_weather", "arguments": {"ci')
    delta.tool_calls  # [{"index": 0, "id": "call_...", "type": "function",
                      #   "function": {"name": "get_weather", "arguments": "{\\"ci"}}]

A format says three things about one model family's way of calling tools: how to read calls out of
its text (`stream`, and `parse` on top of it, so a streamed answer and a whole one agree by
construction), which grammar forces a call (`forced_grammar`, for `tool_choice: required` or a named
function), and how to describe the tools and the past calls in the prompt when the model's chat
template does not take them (`system_prompt`, `render_calls`, `render_results`; tools/prompt.py).
A new format subclasses `ToolCallParser` and registers itself with `@register_tool_parser("name")`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar


class ToolError(ValueError):
    """A tool definition or a tool message that cannot be used; the message is meant for the client."""


@dataclass(frozen=True)
class Function:
    """One function a request offers (OpenAI's `tools[i].function`)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def openai(self) -> dict[str, Any]:
        """As OpenAI's `tools` list holds it, which is what chat templates take (transformers)."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    """A call read from the model's output: `arguments` is the JSON text of its arguments object."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def openai(self) -> dict[str, Any]:
        """As OpenAI's `message.tool_calls[i]`."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Delta:
    """What a stream shows after one more piece of text: content, and tool-call entries in OpenAI's
    streamed shape (the first entry of a call has its id, type and name; later ones add arguments)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def add_call_text(self, index: int, arguments: str, head: ToolCall | None = None) -> None:
        """Arguments text of call `index`, after its head (id, type, name) when `head` is given; merged
        into this delta's entry for the call if it has one already."""
        if not arguments and head is None:
            return
        for existing in self.tool_calls:
            if existing["index"] == index:
                existing["function"]["arguments"] += arguments
                return
        entry: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
        if head is not None:
            entry = {"index": index, "id": head.id, "type": "function"}
            entry["function"] = {"name": head.name, "arguments": arguments}
        self.tool_calls.append(entry)


class ToolCallStream:
    """The calls of one output, read as its text comes. `push` each new piece of text; `finish` with
    the rest once the output ends. Afterwards `calls` holds every call read (complete or, when the
    output was cut, the one being read), and `content` the text that is not calls: None when calls
    came with no text before them, the whole output when none came."""

    calls: list[ToolCall]
    content: str | None

    def push(self, text: str) -> Delta:
        raise NotImplementedError

    def finish(self, text: str = "") -> Delta:
        raise NotImplementedError


class ToolCallParser:
    """One model family's tool-call format; see the module docstring."""

    name: ClassVar[str]

    def stream(self, parallel: bool = True) -> ToolCallStream:
        """A reader for one output; with `parallel` False it keeps the first call only."""
        raise NotImplementedError

    def parse(self, text: str, parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output: what a stream of the same text ends with."""
        stream = self.stream(parallel)
        stream.finish(text)
        return stream.content, stream.calls

    def forced_grammar(self, functions: list[Function], parallel: bool, whitespace: str) -> str:
        """A Lark grammar (llguidance's dialect) whose every sentence is one call (or, with `parallel`,
        one or more) of one of `functions`, with arguments that match its parameters' schema; JSON
        whitespace follows the regex `whitespace` (grammar.WHITESPACE)."""
        raise NotImplementedError

    def system_prompt(self, functions: list[Function]) -> str:
        """The tools, described for a model whose chat template does not take them."""
        raise NotImplementedError

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        """An assistant turn's `tool_calls` (OpenAI's shape) as this format writes them."""
        raise NotImplementedError

    def render_results(self, results: list[str]) -> str:
        """The contents of consecutive `tool` messages, as one user turn."""
        raise NotImplementedError


TOOL_PARSERS: dict[str, type[ToolCallParser]] = {}


def register_tool_parser(name: str):
    """Class decorator: make a format available as ADAPTIVE_SPEC_TOOL_CALL_PARSER=`name`."""

    def register(cls: type[ToolCallParser]) -> type[ToolCallParser]:
        cls.name = name
        TOOL_PARSERS[name] = cls
        return cls

    return register


def tool_parser(name: str) -> ToolCallParser:
    if name not in TOOL_PARSERS:
        raise ToolError(f"unknown tool-call parser {name!r}; registered: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()


def call_schema(function: Function, whitespace: str) -> dict[str, Any]:
    """The JSON schema of one call of `function` as `{"name": ..., "arguments": {...}}`, name first.

    The parameters' `$defs` (and `definitions`) move to the root, where their `#/$defs/...`
    references now point; JSON whitespace follows `whitespace` (llguidance's `x-guidance`)."""
    arguments = dict(function.parameters)
    hoisted: dict[str, Any] = {key: arguments.pop(key) for key in ("$defs", "definitions") if key in arguments}
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        **hoisted,
        "x-guidance": {"whitespace_pattern": whitespace},
    }


def arguments_object(arguments: Any) -> Any:
    """An assistant message's `arguments` (OpenAI sends a JSON string) as chat templates take them: the
    decoded object where it decodes, the text otherwise."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments
