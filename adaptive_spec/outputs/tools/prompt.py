"""Tools and tool turns into a chat prompt: through the model's chat template when it takes them,
else written into the messages by the tool-call format (the fallback).

    messages, tools = tool_prompt(messages, functions, tokenizer, tool_parser("hermes"))
    ids = encode_prompt(messages, tokenizer, vocab_size, max_context, tools=tools)

`messages` are OpenAI's chat messages as dicts: an assistant turn may carry `tool_calls` (its
`content` then may be None) and a `tool` turn answers one call by `tool_call_id`.

- A template that takes tools (transformers' `apply_chat_template(tools=...)`: Qwen's, Hermes',
  Llama 3.1's, ...) gets the tools, the assistant turns' calls with their arguments as objects (what
  those templates expect; OpenAI sends a JSON string) and the `tool` turns as they are.
- A template that does not (SmolLM2's ChatML template ignores `tools`, and would print "None" for an
  assistant turn without content) gets the format's description of the tools at the end of the
  system message (a system message is added when there is none), each assistant turn's calls
  written as the format writes them after its text, and each run of `tool` turns as one user turn
  (`<tool_response>` blocks in Hermes' format), which every template renders.

Whether a template takes tools is found once per tokenizer by rendering a probe tool: it does when
the probe's name shows in the text.
"""

from __future__ import annotations

import functools
from typing import Any

from adaptive_spec.outputs.tools.parser import Function, ToolCallParser, arguments_object

_PROBE = "adaptive_spec_probe_tool"


@functools.lru_cache(maxsize=8)
def template_takes_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders the `tools` it is given."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return False
    probe = Function(_PROBE, "probe", {"type": "object", "properties": {}}).openai()
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tools=[probe], add_generation_prompt=True, tokenize=False
        )
    except Exception:  # a template that raises on tools does not take them
        return False
    return _PROBE in str(text)


def tool_prompt(
    messages: list[dict[str, Any]], functions: list[Function], tokenizer, parser: ToolCallParser
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for `apply_chat_template`: see the module docstring. `functions` may be empty
    (tool_choice none, or a history of calls without tools offered now)."""
    if template_takes_tools(tokenizer):
        tools = [f.openai() for f in functions] or None
        return [_for_template(message) for message in messages], tools
    return _written_in(messages, functions, parser), None


def _for_template(message: dict[str, Any]) -> dict[str, Any]:
    message = dict(message)
    if message.get("content") is None:
        message["content"] = ""
    if message.get("tool_calls"):
        message["tool_calls"] = [
            {**call, "function": {**call["function"], "arguments": arguments_object(call["function"]["arguments"])}}
            for call in message["tool_calls"]
        ]
    return message


def _written_in(messages: list[dict[str, Any]], functions: list[Function], parser: ToolCallParser) -> list[dict]:
    out: list[dict[str, Any]] = []
    results: list[str] = []
    for message in messages:
        if message["role"] == "tool":
            results.append(message.get("content") or "")
            continue
        if results:
            out.append({"role": "user", "content": parser.render_results(results)})
            results = []
        content = message.get("content") or ""
        if message.get("tool_calls"):
            calls = parser.render_calls(message["tool_calls"])
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": message["role"], "content": content})
    if results:
        out.append({"role": "user", "content": parser.render_results(results)})
    if functions:
        described = parser.system_prompt(functions)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{described}"}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out
