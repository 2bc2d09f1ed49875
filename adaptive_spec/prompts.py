"""Prompt files: JSON Lines, one `{"prompt": "..."}` or `{"messages": [...]}` per line.

An optional `"domain"` tag travels with the request into its correction record and metrics, and
an optional `"response_format"` (OpenAI's shape) constrains the output, as on the HTTP API.

    {"messages": [{"role": "user", "content": "Name three rivers."}], "domain": "chat"}
    {"prompt": "def fibonacci(n):", "domain": "python"}
    {"messages": [...], "response_format": {"type": "json_schema", "json_schema": {"name": "order", "schema": {...}}}}

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
    if isinstance(row.get("prompt"), str) and row["prompt"]:
        return PromptItem(row["prompt"], domain, response_format)
    messages = row.get("messages")
    if (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        return PromptItem(messages, domain, response_format)
    raise PromptFileError(
        f"{where}: expected a non-empty 'prompt' string or a 'messages' list of {{'role': ..., 'content': ...}} objects"
    )
