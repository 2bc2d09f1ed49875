"""Tool calling for chat models, as OpenAI's chat API defines it (`tools`, `tool_choice`,
`tool_calls`), with no web code: the HTTP service (service/tool_calls.py) and any notebook use it.

    from adaptive_spec.outputs.tools import Function, tool_parser, tool_prompt
    parser = tool_parser("hermes")
    functions = [Function("get_weather", "The weather in a city", {"type": "object", ...})]
    messages, tools = tool_prompt(messages, functions, engine.tokenizer, parser)   # prompt.py
    out = engine.generate(engine.encode_prompt(...), ...)                           # free, or forced:
    forced = {"type": "grammar", "syntax": "lark",
              "definition": parser.forced_grammar(functions, parallel=False, whitespace=r"\\x20?")}
    content, calls = parser.parse(out.text)

- parser.py: functions, calls, stream deltas, the registry of formats (`TOOL_PARSERS`);
- hermes.py: Hermes-style `<tool_call>{...}</tool_call>`, the first format;
- prompt.py: the tools into the prompt, through the chat template or written in by the format;
- use.py: what `tools`, `tool_choice` and `parallel_tool_calls` do to one request (`ToolUse`).

A forced call is a grammar like any structured output (grammar.py), so it stays lossless under
speculation: the mask applies to the target's and the draft's tokens alike.
"""

from adaptive_spec.outputs.tools import hermes
from adaptive_spec.outputs.tools.parser import (
    TOOL_PARSERS,
    Delta,
    Function,
    ToolCall,
    ToolCallParser,
    ToolCallStream,
    ToolError,
    register_tool_parser,
    tool_parser,
)
from adaptive_spec.outputs.tools.prompt import template_takes_tools, tool_prompt
from adaptive_spec.outputs.tools.use import ToolUse

__all__ = [
    "TOOL_PARSERS",
    "Delta",
    "Function",
    "ToolCall",
    "ToolCallParser",
    "ToolCallStream",
    "ToolError",
    "ToolUse",
    "hermes",
    "register_tool_parser",
    "template_takes_tools",
    "tool_parser",
    "tool_prompt",
]
