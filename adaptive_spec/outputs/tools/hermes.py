"""Hermes-style tool calls, the format of Qwen's and NousResearch Hermes' chat templates (vLLM's
`--tool-call-parser hermes`): each call is a JSON object between tags, after any text.

    I will look it up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
    </tool_call>

Read back as content "I will look it up." and one call `get_weather` with arguments
`{"city": "Paris", "unit": "celsius"}` (the text the model wrote). Text between and after calls is
dropped, as vLLM does; a block whose JSON does not parse is dropped too, and an output with no call
that parses is all content. An output cut inside a call (max_tokens) keeps that call as far as it
got once its name was read, as OpenAI's `finish_reason: "length"` answers do. Streamed, content goes out as it comes, except an end that could start
`<tool_call>` and trailing whitespace before one; a call's head (id and name) goes out as soon as
`"name": "...", "arguments":` is read, and its arguments object piece by piece as it is written.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from adaptive_spec.outputs.tools.parser import (
    Delta,
    Function,
    ToolCall,
    ToolCallParser,
    ToolCallStream,
    arguments_object,
    call_schema,
    register_tool_parser,
)

START, END = "<tool_call>", "</tool_call>"
# The start of a call whose name comes first, up to where its arguments' value begins.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')

SYSTEM_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@register_tool_parser("hermes")
class HermesParser(ToolCallParser):
    def stream(self, parallel: bool = True) -> ToolCallStream:
        return HermesStream(parallel)

    def forced_grammar(self, functions: list[Function], parallel: bool, whitespace: str) -> str:
        """One call (more, separated by a newline, with `parallel`) of any of `functions`:

        start: call ("\\n" call)*
        call: "<tool_call>\\n" body "\\n</tool_call>"
        body: fn0 | fn1
        fn0: %json {"type": "object", "properties": {"name": {"const": "get_weather"}, ...}}
        """
        rules = [
            'start: call ("\\n" call)*' if parallel else "start: call",
            f"call: {json.dumps(START + chr(10))} body {json.dumps(chr(10) + END)}",
            "body: " + " | ".join(f"fn{i}" for i in range(len(functions))),
        ]
        rules += [f"fn{i}: %json {json.dumps(call_schema(f, whitespace))}" for i, f in enumerate(functions)]
        return "\n".join(rules)

    def system_prompt(self, functions: list[Function]) -> str:
        return SYSTEM_PROMPT.format(tools="\n".join(json.dumps(f.openai(), ensure_ascii=False) for f in functions))

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        blocks = []
        for call in calls:
            function = call.get("function", call)
            arguments = arguments_object(function.get("arguments", {}))
            body = json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)
            blocks.append(f"{START}\n{body}\n{END}")
        return "\n".join(blocks)

    def render_results(self, results: list[str]) -> str:
        return "\n".join(f"<tool_response>\n{result}\n</tool_response>" for result in results)


@dataclass
class _Streaming:
    """A call whose head has gone out while its block is still open."""

    block: int  # where its <tool_call> starts in the text
    call: ToolCall  # its id and name; arguments as sent so far


class HermesStream(ToolCallStream):
    def __init__(self, parallel: bool) -> None:
        self.parallel = parallel
        self.text = ""
        self.shown = 0  # characters of the text sent as content
        self.content_sent = ""
        self.first_block: int | None = None  # where the first <tool_call> starts, once seen
        self.scan = 0  # where the next block is looked for
        self.calls: list[ToolCall] = []
        self.open: _Streaming | None = None
        self.content = None

    def push(self, text: str) -> Delta:
        self.text += text
        return self._advance(final=False)

    def finish(self, text: str = "") -> Delta:
        self.text += text
        delta = self._advance(final=True)
        if self.open is not None:  # cut inside a call (max_tokens): the call as far as it got
            self.calls.append(self.open.call)
            self.open = None
        if not self.calls:  # no call: everything is content
            self._content(delta, len(self.text))
            self.content = self.content_sent
        else:
            self.content = self.content_sent or None
        return delta

    def _advance(self, final: bool) -> Delta:
        delta = Delta()
        text = self.text
        if self.first_block is None:
            at = text.find(START)
            if at < 0:
                if not final:  # hold back what may start a <tool_call>, and trailing whitespace
                    self._content(delta, len(text[: len(text) - _partial_start(text)].rstrip()))
                return delta
            self.first_block = self.scan = at
            self._content(delta, len(text[:at].rstrip()))
        while self.parallel or not self.calls:
            start = text.find(START, self.scan)
            if start < 0:
                break
            body = start + len(START)
            end = text.find(END, body)
            if end < 0:  # still open; at the end, cut by max_tokens: kept as far as it got, streamed or not
                self._stream_open(start, body, delta)
                break
            self._close(start, text[body:end], delta)
            self.scan = end + len(END)
        return delta

    def _content(self, delta: Delta, end: int) -> None:
        if end > self.shown:
            piece = self.text[self.shown : end]
            self.shown = end
            self.content_sent += piece
            delta.content += piece

    def _stream_open(self, start: int, body: int, delta: Delta) -> None:
        """Send the head of the open call once its name is read, then its arguments as written."""
        head = _HEAD.match(self.text, body)
        if head is None:
            return  # not read far enough, or the name does not come first: the call goes out whole
        new = self.open is None
        if new:
            self.open = _Streaming(start, ToolCall(_unquote(head.group(1)), ""))
        assert self.open is not None
        at = head.end()
        written = self.text[at : _value_end(self.text, at)] if self.text[at : at + 1] in ("{", "[") else ""
        piece = written[len(self.open.call.arguments) :]
        self.open.call.arguments = written
        delta.add_call_text(len(self.calls), piece, self.open.call if new else None)

    def _close(self, start: int, body: str, delta: Delta) -> None:
        """A complete block: its call, or nothing when its JSON does not parse."""
        streaming = self.open if self.open is not None and self.open.block == start else None
        self.open = None
        call = _parse_call(body)
        if call is None:
            if streaming is not None:  # its head went out already: keep it as written
                self.calls.append(streaming.call)
            return
        if streaming is not None and call.arguments.startswith(streaming.call.arguments):
            call.id = streaming.call.id
            delta.add_call_text(len(self.calls), call.arguments[len(streaming.call.arguments) :])
        else:
            delta.add_call_text(len(self.calls), call.arguments, call)
        self.calls.append(call)


def _parse_call(body: str) -> ToolCall | None:
    """`{"name": ..., "arguments": {...}}` -> a call whose arguments are the text the model wrote."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        return ToolCall(obj["name"], arguments)
    head = _HEAD.match(body)
    if head is not None:
        value, end = json.JSONDecoder().raw_decode(body, head.end())
        if value == arguments:
            return ToolCall(obj["name"], body[head.end() : end])
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _value_end(text: str, at: int) -> int:
    """Where the JSON object or array starting at `at` ends (just past its closing bracket), or the
    end of `text` while it is still open."""
    depth, in_string, escaped = 0, False, False
    for i in range(at, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _partial_start(text: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of <tool_call>."""
    for n in range(min(len(START) - 1, len(text)), 0, -1):
        if text.endswith(START[:n]):
            return n
    return 0


def _unquote(name: str) -> str:
    try:
        return json.loads(f'"{name}"')
    except json.JSONDecodeError:
        return name
