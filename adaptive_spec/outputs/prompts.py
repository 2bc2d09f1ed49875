"""Prompt files: JSON Lines, one `{"prompt": "..."}` or `{"messages": [...]}` per line.

An optional `"domain"` tag travels with the request into its correction record and metrics, and
an optional `"response_format"` (OpenAI's shape) constrains the output, as on the HTTP API. A chat
line may carry OpenAI's `"tools"` and `"tool_choice"` too, and its messages may hold assistant
`tool_calls` and `tool` results (agent traffic: the shipped set `tool_calls`).

    {"messages": [{"role": "user", "content": "Name three rivers."}], "domain": "chat"}
    {"prompt": "def fibonacci(n):", "domain": "python"}
    {"messages": [...], "response_format": {"type": "json_schema", "json_schema": {"name": "order", "schema": {...}}}}
    {"messages": [...], "tools": [{"type": "function", "function": {"name": ..., "parameters": {...}}}], "tool_choice": "required"}

`encode_item` gives a line's token ids and the grammar its request runs under, as the server
builds them, for benchmarks that call the engine directly; `request_fields` its HTTP body fields.

The prompt sets the benchmarks ship, and names for them, are in benchmarks/prompts/.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PromptItem:
    prompt: str | list[dict]  # text, or chat messages
    domain: str | None = None
    response_format: dict | None = None  # checked by the engine (grammar.py), as a request's would be
    tools: list[dict] | None = None  # OpenAI's `tools` (chat lines only)
    tool_choice: str | dict | None = None  # OpenAI's `tool_choice`; None: auto when tools are given

    def request_fields(self) -> dict:
        """The OpenAI body fields besides the prompt that this line sets."""
        fields = {"response_format": self.response_format, "tools": self.tools, "tool_choice": self.tool_choice}
        return {key: value for key, value in fields.items() if value is not None}


def encode_item(item: PromptItem, engine) -> tuple[list[int], dict | None]:
    """A line's token ids and the response_format its request runs under (a forced tool call's grammar
    when it forces one), as the server builds them (adaptive_spec/outputs/tools/use.py)."""
    from adaptive_spec.outputs.tokens import encode_prompt
    from adaptive_spec.outputs.tools.use import ToolUse

    prompt = item.prompt
    if isinstance(prompt, str) or not prompt or not isinstance(prompt[0], dict):  # text or token ids: no tools
        return engine.encode_prompt(prompt), item.response_format
    use = ToolUse.of(item.tools, item.tool_choice, None, prompt)
    if use is None:
        return engine.encode_prompt(prompt), item.response_format
    messages, tools = use.prompt(prompt, engine.tokenizer)
    ids = encode_prompt(messages, engine.tokenizer, engine.vocab_size, engine.max_context, tools=tools)
    return ids, use.response_format(engine.json_whitespace) or item.response_format


class PromptFileError(ValueError):
    pass


def load_prompts(path: str | Path) -> list[PromptItem]:
    """Read a prompt file, with an error naming the line for anything malformed."""
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"prompt file not found: {path}")
    items = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptFileError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        items.append(_item(row, f"{path}:{number}"))
    if not items:
        raise PromptFileError(f"{path}: no prompts in the file")
    return items


def _item(row, where: str) -> PromptItem:
    if not isinstance(row, dict):
        raise PromptFileError(f"{where}: each line must be a JSON object")
    domain = row.get("domain")
    if domain is not None and not isinstance(domain, str):
        raise PromptFileError(f"{where}: 'domain' must be a string")
    response_format = row.get("response_format")
    if response_format is not None and not (
        isinstance(response_format, dict) and isinstance(response_format.get("type"), str)
    ):
        raise PromptFileError(f"{where}: 'response_format' must be an object with a 'type', as in OpenAI's API")
    tools, tool_choice = row.get("tools"), row.get("tool_choice")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools)
    ):
        raise PromptFileError(
            f"{where}: 'tools' must be a list of OpenAI tools ({{'type': 'function', 'function': {{...}}}})"
        )
    if tool_choice is not None and not isinstance(tool_choice, (str, dict)):
        raise PromptFileError(f"{where}: 'tool_choice' must be a string or an object, as in OpenAI's API")
    if isinstance(row.get("prompt"), str) and row["prompt"]:
        if tools is not None:
            raise PromptFileError(f"{where}: 'tools' go with 'messages', not a text 'prompt'")
        return PromptItem(row["prompt"], domain, response_format)
    messages = row.get("messages")
    if isinstance(messages, list) and messages and all(_message(m) for m in messages):
        return PromptItem(messages, domain, response_format, tools, tool_choice)
    raise PromptFileError(
        f"{where}: expected a non-empty 'prompt' string or a 'messages' list of {{'role': ..., 'content': ...}} objects"
    )


def _message(message) -> bool:
    """A chat message: a role and text content, or an assistant turn's `tool_calls` without content."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        return False
    if isinstance(message.get("content"), str):
        return True
    return (
        message["role"] == "assistant"
        and isinstance(message.get("tool_calls"), list)
        and message.get("content") is None
    )
