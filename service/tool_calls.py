"""Tool calling on /v1/chat/completions: a checked request's `tools`, `tool_choice` and
`parallel_tool_calls` as the core's `ToolUse` (adaptive_spec/outputs/tools/use.py says what each does), in
the format ADAPTIVE_SPEC_TOOL_CALL_PARSER names (`hermes`).

    curl -s localhost:8000/v1/chat/completions -H 'content-type: application/json' -d '{
      "model": "smollm2-135m-instruct", "max_tokens": 96, "temperature": 0, "tool_choice": "required",
      "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
      "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]}'

A forced call is a grammar like a `response_format` (adaptive_spec/outputs/grammar.py), so it stays lossless
under speculation; a parameters schema the grammar library cannot enforce is a 400 naming `tools`.
"""

from __future__ import annotations

from adaptive_spec.outputs.tools.use import ToolUse
from service.schemas import ChatRequest


def tool_use(body: ChatRequest, parser: str) -> ToolUse | None:
    """None when the request has nothing to do with tools."""
    tools = [tool.model_dump() for tool in body.tools] if body.tools else None
    choice = body.tool_choice if isinstance(body.tool_choice, (str, type(None))) else body.tool_choice.model_dump()
    messages = [{"role": m.role, "tool_calls": m.tool_calls} for m in body.messages]
    return ToolUse.of(tools, choice, body.parallel_tool_calls, messages, parser)
