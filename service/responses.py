"""OpenAI response bodies for chat and text completions, whole or as stream chunks.

The figures for speculation ride in `usage.spec_decode` (DESIGN.md, HTTP contract), summed over
a request's n choices:

    "usage": {"prompt_tokens": 12, "completion_tokens": 40, "total_tokens": 52,
              "prompt_tokens_details": {"cached_tokens": 0},
              "spec_decode": {"num_draft_tokens": 40, "num_accepted_tokens": 30, "num_drafts": 10,
                              "acceptance_rate": 0.75, "mean_acceptance_length": 4.0,
                              "adapter_version": "3"}}

Drafts that copy (`ngram+head`, `ngram+early-exit:N`) add `num_free_draft_tokens` and
`num_free_accepted_tokens`: the share of the draft and accepted tokens that were copied from the
context or the adapter's n-gram index, with no draft forward (0 for other drafts).
`mean_acceptance_length` is tokens emitted per target forward (`RequestStats`): 30 accepted
plus one recovered or bonus token per forward over 10 forwards = 4.0. `adapter_version` is
null for the base draft. The prompt is counted once however many choices share it.

Log-probabilities come in each endpoint's own OpenAI shape, one entry per output token (EOS
included, as in `token_ids`):

    chat:        "logprobs": {"content": [{"token": " Paris", "logprob": -0.31, "bytes": [32, 80, ...],
                                           "top_logprobs": [{"token": " Paris", "logprob": -0.31, ...}, ...]}],
                              "refusal": null}
    completions: "logprobs": {"tokens": [" Paris"], "token_logprobs": [-0.31],
                              "top_logprobs": [{" Paris": -0.31, " Lyon": -2.1}], "text_offset": [0]}

`bytes` are the token's own bytes, so that a character split over two tokens still adds up:
joining every token's bytes gives the UTF-8 of the text. A model without a tokenizer names its
tokens `token_id:<id>`, as vLLM does.

Completion choices also carry `token_ids` (an extension, as vLLM's `return_token_ids`): the
only output of an engine without a tokenizer, whose `text` is then "".
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass

from adaptive_spec.engine import GenerationOutput
from adaptive_spec.formats.stats import Totals
from adaptive_spec.outputs.tools import ToolCall, ToolCallStream

CHAT, COMPLETION = "chat", "completion"
MIN_LOGPROB = -9999.0  # what OpenAI shows for a token the model rules out (JSON has no -inf)


def usage(prompt_tokens: int, outputs: list[GenerationOutput]) -> dict:
    stats = [output.stats for output in outputs]
    total = Totals()
    for one in stats:
        total.include(one)
    completion_tokens = sum(len(output.token_ids) for output in outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        # prompt tokens whose keys and values the prefix cache held (adaptive_spec/cache/prefix.py), as OpenAI
        "prompt_tokens_details": {"cached_tokens": stats[0].cached_tokens if stats else 0},
        "spec_decode": {
            "num_draft_tokens": total.drafted,
            "num_accepted_tokens": total.accepted,
            "num_free_draft_tokens": sum(s.free_drafted for s in stats),  # copied by ngram+ drafts
            "num_free_accepted_tokens": sum(s.free_accepted for s in stats),
            "num_drafts": total.drafted_per_pos[0] if total.drafted_per_pos else 0,
            "num_verify_forwards": total.target_forwards,  # target forwards while decoding (the prefill apart)
            "num_drafts_per_pos": total.drafted_per_pos,  # drafts reaching depth i + 1 (a tree's level)
            "num_accepted_tokens_per_pos": total.accepted_per_pos,  # of which the token at that depth was kept
            "acceptance_rate": total.acceptance_rate,
            "mean_acceptance_length": total.mean_acceptance_length,
            "adapter_version": stats[0].adapter_version,
        },
    }


@dataclass
class Logprobs:
    """The log-probabilities of some consecutive output tokens (a whole choice, or one stream chunk)."""

    token_ids: list[int]
    values: list[float]  # [n] the target's log-probability of each token
    top: list[list[tuple[int, float]]] | None  # [n][alternatives], None when no alternatives were asked
    text_offset: int = 0  # where the first token starts in the choice's text (completions)

    @classmethod
    def of(cls, output: GenerationOutput, start: int = 0, stop: int | None = None, text_offset: int = 0) -> Logprobs:
        stop = len(output.token_ids) if stop is None else stop
        top = None if output.top_logprobs is None else output.top_logprobs[start:stop]
        return cls(output.token_ids[start:stop], output.logprobs[start:stop], top, text_offset)


class TokenText:
    """What one token looks like in a logprobs entry: its text and its bytes, cached by id.

    Byte-level BPE vocabularies (GPT-2's, SmolLM2's, Llama 3's) spell each token's bytes with
    printable stand-ins ("Ġ" for a space); mapping them back gives the exact bytes even of a token
    that holds half a character, whose decoded text is only "\\ufffd".
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._cache: dict[int, tuple[str, list[int] | None]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int] | None]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._look_up(token_id)
        return found

    def _look_up(self, token_id: int) -> tuple[str, list[int] | None]:
        if self.tokenizer is None:
            return f"token_id:{token_id}", None
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        piece = self.tokenizer.convert_ids_to_tokens(token_id) if self._byte_level else None
        if piece is not None and all(ch in _BYTE_OF_CHAR for ch in piece):
            return text, [_BYTE_OF_CHAR[ch] for ch in piece]
        return text, list(text.encode("utf-8"))


@functools.lru_cache(maxsize=4)
def token_text(tokenizer) -> TokenText:
    """One TokenText per tokenizer, so its cache lives as long as the server."""
    return TokenText(tokenizer)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte (`bytes_to_unicode`), reversed: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    stand_ins = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(shifted)}
    return {char: byte for byte, char in stand_ins.items()}


_BYTE_OF_CHAR = _byte_level_alphabet()


def tool_calls_finish(finish_reason: str | None, calls: list[ToolCall]) -> str | None:
    """OpenAI's finish_reason for an output that called tools: `tool_calls`, unless it was cut."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


@dataclass
class Formatter:
    """Builds the bodies of one request: `kind` is CHAT or COMPLETION; `tokens` names tokens in
    log-probabilities (`token_text(engine.tokenizer)`); `tool_reader` gives a reader of tool calls
    per choice when the request offers tools (service/tool_calls.py)."""

    kind: str
    request_id: str
    created: int
    model: str
    fingerprint: str
    tokens: TokenText | None = None
    tool_reader: Callable[[], ToolCallStream | None] | None = None

    def tool_calls_reader(self) -> ToolCallStream | None:
        return None if self.tool_reader is None else self.tool_reader()

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.kind == CHAT else "cmpl-") + self.request_id

    def _envelope(self, chunk: bool) -> dict:
        obj = {CHAT: "chat.completion", COMPLETION: "text_completion"}[self.kind]
        return {
            "id": self.id,
            "object": obj + (".chunk" if chunk and self.kind == CHAT else ""),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
        }

    def completion(self, outputs: list[GenerationOutput], prompt_tokens: int) -> dict:
        """The whole response to a request whose n choices are `outputs`, in choice order."""
        choices = []
        for index, output in enumerate(outputs):
            text = output.text or ""
            logprobs = self.logprobs(Logprobs.of(output)) if output.logprobs is not None else None
            finish_reason = output.finish_reason
            if self.kind == CHAT:
                message: dict = {"role": "assistant", "content": text}
                reader = self.tool_calls_reader()
                if reader is not None:
                    reader.finish(text)
                    if reader.calls:
                        message = {"role": "assistant", "content": reader.content}
                        message["tool_calls"] = [call.openai() for call in reader.calls]
                        finish_reason = tool_calls_finish(finish_reason, reader.calls)
                choices.append({"index": index, "message": message, "logprobs": logprobs})
            else:
                choices.append({"index": index, "text": text, "logprobs": logprobs})
            choices[-1]["finish_reason"] = finish_reason
            if self.kind == COMPLETION:
                choices[-1]["token_ids"] = list(output.token_ids)
        return {**self._envelope(False), "choices": choices, "usage": usage(prompt_tokens, outputs)}

    def chunk(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        finish_reason: str | None = None,
        *,
        first: bool = False,
        logprobs: Logprobs | None = None,
        with_usage_field: bool = False,
        tool_calls: list[dict] | None = None,
    ) -> dict:
        """`tool_calls`: OpenAI's streamed entries (index; id, type and name first; arguments in pieces)."""
        shown = None if logprobs is None else self.logprobs(logprobs)
        if self.kind == CHAT:
            delta: dict = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta, "logprobs": shown, "finish_reason": finish_reason}
        else:
            choice = {
                "index": index,
                "text": text,
                "logprobs": shown,
                "finish_reason": finish_reason,
                "token_ids": token_ids,
            }
        body = {**self._envelope(True), "choices": [choice]}
        if with_usage_field:
            body["usage"] = None  # as OpenAI: every chunk has it, null except in the last one
        return body

    def usage_chunk(self, outputs: list[GenerationOutput], prompt_tokens: int) -> dict:
        return {**self._envelope(True), "choices": [], "usage": usage(prompt_tokens, outputs)}

    def logprobs(self, lp: Logprobs) -> dict:
        """`lp` in this endpoint's shape (see the module docstring)."""
        name = self.tokens or token_text(None)
        values = [max(value, MIN_LOGPROB) for value in lp.values]
        tops = lp.top or [[] for _ in lp.token_ids]
        if self.kind == CHAT:
            return {
                "content": [
                    {**_entry(name, token, value), "top_logprobs": [_entry(name, i, v) for i, v in top]}
                    for token, value, top in zip(lp.token_ids, values, tops, strict=True)
                ],
                "refusal": None,
            }
        tokens = [name(token)[0] for token in lp.token_ids]
        offsets, at = [], lp.text_offset
        for text in tokens:
            offsets.append(at)
            at += len(text)
        top_dicts = []
        for text, value, top in zip(tokens, values, tops, strict=True):
            alternatives: dict[str, float] = {}
            for token, v in top:  # two ids that decode alike keep the likelier one's figure
                alternatives.setdefault(name(token)[0], max(v, MIN_LOGPROB))
            alternatives.setdefault(text, value)  # the chosen token is always there, as OpenAI's
            top_dicts.append(alternatives)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": top_dicts, "text_offset": offsets}


def _entry(name: TokenText, token: int, value: float) -> dict:
    text, raw = name(token)
    return {"token": text, "logprob": max(value, MIN_LOGPROB), "bytes": raw}


def sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"
