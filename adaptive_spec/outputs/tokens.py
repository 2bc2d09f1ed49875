"""From what a user sends to token ids and back: prompts (ids, text or chat messages) checked and
encoded, the ids that end a generation, and where a stop string cuts the output.

    ids = encode_prompt([{"role": "user", "content": "hi"}], tokenizer, vocab_size=49152, max_context=8192)
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class InputError(ValueError):
    """A request the engine refuses, with a message meant for the caller."""


CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def encode_prompt(
    prompt, tokenizer, vocab_size: int, max_context: int | None, tools: list[dict] | None = None
) -> list[int]:
    """Token ids for a prompt given as ids, a string, or chat messages; InputError names what is wrong.
    `tools` (OpenAI's shape) go to the chat template with chat messages (adaptive_spec/outputs/tools/prompt.py)."""
    if isinstance(prompt, str):
        ids = _need_tokenizer(tokenizer, "a text prompt").encode(prompt)
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        ids = _chat_ids(tokenizer, list(prompt), tools)
    elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InputError(f"token ids must be in [0, {vocab_size}); got {bad[:5]}")
    elif isinstance(prompt, torch.Tensor) and prompt.dim() == 1:
        return encode_prompt(prompt.tolist(), tokenizer, vocab_size, max_context)
    else:
        raise InputError(
            "prompt must be a list of token ids, a string, or a list of chat messages ({'role': ..., 'content': ...})"
        )
    if not ids:
        raise InputError("the prompt is empty")
    if max_context is not None and len(ids) >= max_context:
        raise InputError(
            f"the prompt has {len(ids)} tokens, over the model's context of {max_context} "
            f"(at least one must remain for the output)"
        )
    return ids


def _chat_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    tokenizer = _need_tokenizer(tokenizer, "chat messages")
    for i, message in enumerate(messages):
        if message.get("role") not in CHAT_ROLES:
            raise InputError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {message.get('role')!r}")
        if not isinstance(message.get("content"), str):
            raise InputError(f"messages[{i}].content must be a string")
    extra = {"tools": tools} if tools else {}
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
    if hasattr(encoded, "keys"):  # transformers 5 returns a BatchEncoding
        encoded = encoded["input_ids"]
    return list(encoded)


def _need_tokenizer(tokenizer, what: str):
    if tokenizer is None:
        raise InputError(f"{what} need a tokenizer; this engine has none, so pass token ids")
    return tokenizer


def tokens_until_stop(decode: Callable[[list[int]], str | None], out: list[int], stops: tuple[str, ...]) -> int:
    """The shortest prefix of `out` whose text contains a stop string."""
    for n in range(1, len(out) + 1):
        text = decode(out[:n]) or ""
        if any(s in text for s in stops):
            return n
    return len(out)


def eos_ids(model, tokenizer, override) -> set[int]:
    """The ids that end a generation: `override`, else every eos id the model and tokenizer name."""
    if override is not None:
        return {override} if isinstance(override, int) else set(override)
    found = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            found.add(value)
        elif isinstance(value, (list, tuple)):
            found.update(v for v in value if isinstance(v, int))
    return found
