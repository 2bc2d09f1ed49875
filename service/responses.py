"""OpenAI response bodies for chat and text completions, whole or as stream chunks.

The figures for speculation ride in `usage.spec_decode` (DESIGN.md, HTTP contract):

    "usage": {"prompt_tokens": 12, "completion_tokens": 40, "total_tokens": 52,
              "spec_decode": {"num_draft_tokens": 40, "num_accepted_tokens": 30, "num_drafts": 10,
                              "acceptance_rate": 0.75, "mean_acceptance_length": 4.0,
                              "adapter_version": "3"}}

`mean_acceptance_length` is tokens emitted per target forward (`RequestStats`): 30 accepted
plus one recovered or bonus token per forward over 10 forwards = 4.0. `adapter_version` is
null for the base draft.

Completion choices also carry `token_ids` (an extension, as vLLM's `return_token_ids`): the
only output of an engine without a tokenizer, whose `text` is then "".
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from adaptive_spec.engine import GenerationOutput
from adaptive_spec.stats import RequestStats

CHAT, COMPLETION = "chat", "completion"


def usage(prompt_tokens: int, output: GenerationOutput) -> dict:
    stats: RequestStats = output.stats
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(output.token_ids),
        "total_tokens": prompt_tokens + len(output.token_ids),
        "spec_decode": {
            "num_draft_tokens": stats.drafted,
            "num_accepted_tokens": stats.accepted,
            "num_drafts": stats.drafted_per_pos[0] if stats.drafted_per_pos else 0,
            "acceptance_rate": stats.acceptance_rate,
            "mean_acceptance_length": stats.mean_acceptance_length,
            "adapter_version": stats.adapter_version,
        },
    }


@dataclass
class Formatter:
    """Builds the bodies of one request: `kind` is CHAT or COMPLETION."""

    kind: str
    request_id: str
    created: int
    model: str
    fingerprint: str

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

    def completion(self, output: GenerationOutput, prompt_tokens: int) -> dict:
        text = output.text or ""
        if self.kind == CHAT:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": output.finish_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": output.finish_reason,
                "token_ids": list(output.token_ids),
            }
        return {**self._envelope(False), "choices": [choice], "usage": usage(prompt_tokens, output)}

    def chunk(
        self,
        text: str,
        token_ids: list[int],
        finish_reason: str | None = None,
        *,
        first: bool = False,
        with_usage_field: bool = False,
    ) -> dict:
        if self.kind == CHAT:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "token_ids": token_ids,
            }
        body = {**self._envelope(True), "choices": [choice]}
        if with_usage_field:
            body["usage"] = None  # as OpenAI: every chunk has it, null except in the last one
        return body

    def usage_chunk(self, output: GenerationOutput, prompt_tokens: int) -> dict:
        return {**self._envelope(True), "choices": [], "usage": usage(prompt_tokens, output)}


def sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"
