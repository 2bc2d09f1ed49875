"""Tool calling on /v1/chat/completions: what `tools`, `tool_choice` and `parallel_tool_calls` do to
one request. The format itself (reading calls, forcing them, describing tools) is the core's
(adaptive_spec/tools), chosen by ADAPTIVE_SPEC_TOOL_CALL_PARSER (`hermes`).

    curl -s localhost:8000/v1/chat/completions -H 'content-type: application/json' -d '{
      "model": "smollm2-135m-instruct", "max_tokens": 96, "temperature": 0, "tool_choice": "required",
      "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
      "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]}'

| tool_choice | the prompt | the output |
|---|---|---|
| `auto` (the default with tools) | the tools | free; calls read from it (finish_reason `tool_calls` when there are any) |
| `required` | the tools | a grammar forces one call (more with `parallel_tool_calls`) of any tool, arguments valid against its schema |
| `{"type": "function", "function": {"name": "f"}}` | the tools | the same, of `f` only |
| `none` | no tools (the history's calls and results stay) | free text, not read for calls |

`parallel_tool_calls: false` keeps an `auto` answer to its first call and forces exactly one call.
A forced call is a grammar like a `response_format` (adaptive_spec/grammar.py), so it stays lossless
under speculation; a parameters schema the grammar library cannot enforce is a 400 naming `tools`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adaptive_spec.grammar import WHITESPACE
from adaptive_spec.tools import Function, ToolCallParser, ToolCallStream, tool_parser, tool_prompt
from service.schemas import ChatRequest, NamedToolChoice


@dataclass(frozen=True)
class ToolCalling:
    """Tool calling for one chat request: what it offers and forces, and how its output is read."""

    parser: ToolCallParser
    functions: list[Function]  # offered in the prompt (none with tool_choice none)
    forced: list[Function]  # one of these must be called (required: all; a named function: it); [] = free
    parallel: bool
    reads_calls: bool  # whether the output is read for calls (not with tool_choice none)

    @classmethod
    def of(cls, body: ChatRequest, parser_name: str) -> ToolCalling | None:
        """None when the request has nothing to do with tools (no tools, no calls in its history)."""
        history = any(m.tool_calls or m.role == "tool" for m in body.messages)
        if not body.tools and not history:
            return None
        offered = [
            Function(t.function.name, t.function.description, t.function.parameters or _NO_ARGUMENTS)
            for t in body.tools or []
        ]
        choice = body.tool_choice if body.tool_choice is not None else ("auto" if offered else "none")
        forced: list[Function] = []
        if choice == "required":
            forced = offered
        elif isinstance(choice, NamedToolChoice):
            forced = [f for f in offered if f.name == choice.function.name]
        return cls(
            parser=tool_parser(parser_name),
            functions=[] if choice == "none" else offered,
            forced=forced,
            parallel=body.parallel_tool_calls is not False,
            reads_calls=choice != "none",
        )

    def prompt(self, messages: list[dict[str, Any]], tokenizer) -> tuple[list[dict[str, Any]], list[dict] | None]:
        """The messages and the `tools` to give the chat template (adaptive_spec/tools/prompt.py)."""
        return tool_prompt(messages, self.functions, tokenizer, self.parser)

    def response_format(self, json_whitespace: str) -> dict | None:
        """The grammar that forces a call, as Engine.request takes it; None when nothing is forced."""
        if not self.forced:
            return None
        definition = self.parser.forced_grammar(self.forced, self.parallel, WHITESPACE[json_whitespace])
        return {"type": "grammar", "syntax": "lark", "definition": definition}

    def reader(self) -> ToolCallStream | None:
        """A reader of one choice's output, streamed or whole; None when calls are not read."""
        return self.parser.stream(self.parallel) if self.reads_calls else None


_NO_ARGUMENTS = {"type": "object", "properties": {}}
