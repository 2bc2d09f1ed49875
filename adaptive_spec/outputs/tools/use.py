"""What `tools`, `tool_choice` and `parallel_tool_calls` do to one chat request, for the HTTP service
(service/tool_calls.py) and the benchmarks' engine-level runs alike.

    use = ToolUse.of(tools, "required", parallel_tool_calls=False, messages=messages)   # None: no tools at all
    messages, template_tools = use.prompt(messages, engine.tokenizer)
    ids = encode_prompt(messages, engine.tokenizer, engine.vocab_size, engine.max_context, tools=template_tools)
    out = engine.generate(ids, 96, response_format=use.response_format(engine.json_whitespace))
    content, calls = use.parser.parse(out.text, use.parallel)

| tool_choice | the prompt | the output |
|---|---|---|
| `auto` (the default with tools) | the tools | free; calls read from it |
| `required` | the tools | a grammar forces one call (more with `parallel_tool_calls`) of any tool |
| `{"type": "function", "function": {"name": "f"}}` | the tools | the same, of `f` only |
| `none` | no tools (the history's calls and results stay) | free text, not read for calls |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adaptive_spec.outputs.grammar import WHITESPACE
from adaptive_spec.outputs.tools.parser import Function, ToolCallParser, ToolCallStream, ToolError, tool_parser
from adaptive_spec.outputs.tools.prompt import tool_prompt

DEFAULT_PARSER = "hermes"
_NO_ARGUMENTS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolUse:
    """Tool calling for one chat request: what it offers and forces, and how its output is read."""

    parser: ToolCallParser
    functions: list[Function]  # offered in the prompt (none with tool_choice none)
    forced: list[Function]  # one of these must be called (required: all; a named function: it); [] = free
    parallel: bool
    reads_calls: bool  # whether the output is read for calls (not with tool_choice none)

    @classmethod
    def of(
        cls,
        tools: list[dict[str, Any]] | None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        messages: list[dict[str, Any]] | None = None,
        parser: str = DEFAULT_PARSER,
    ) -> ToolUse | None:
        """From OpenAI's fields (already checked, as service/schemas.py does); None when the request has
        nothing to do with tools (no tools, no calls or results in its history)."""
        history = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages or [])
        if not tools and not history:
            return None
        offered = [
            Function(
                t["function"]["name"],
                t["function"].get("description"),
                t["function"].get("parameters") or _NO_ARGUMENTS,
            )
            for t in tools or []
        ]
        choice = tool_choice if tool_choice is not None else ("auto" if offered else "none")
        forced: list[Function] = []
        if choice == "required":
            forced = offered
        elif isinstance(choice, dict):
            name = choice.get("function", {}).get("name")
            forced = [f for f in offered if f.name == name]
            if not forced:
                raise ToolError(f"tool_choice names the function {name!r}, which is not in tools")
        elif choice not in ("auto", "none"):
            raise ToolError(f"tool_choice must be auto, none, required or a function, not {choice!r}")
        return cls(
            parser=tool_parser(parser),
            functions=[] if choice == "none" else offered,
            forced=forced,
            parallel=parallel_tool_calls is not False,
            reads_calls=choice != "none",
        )

    def prompt(self, messages: list[dict[str, Any]], tokenizer) -> tuple[list[dict[str, Any]], list[dict] | None]:
        """The messages and the `tools` to give the chat template (prompt.py)."""
        return tool_prompt(messages, self.functions, tokenizer, self.parser)

    def response_format(self, json_whitespace: str = "compact") -> dict | None:
        """The grammar that forces a call, as Engine.request takes it; None when nothing is forced."""
        if not self.forced:
            return None
        definition = self.parser.forced_grammar(self.forced, self.parallel, WHITESPACE[json_whitespace])
        return {"type": "grammar", "syntax": "lark", "definition": definition}

    def reader(self) -> ToolCallStream | None:
        """A reader of one choice's output, streamed or whole; None when calls are not read."""
        return self.parser.stream(self.parallel) if self.reads_calls else None
