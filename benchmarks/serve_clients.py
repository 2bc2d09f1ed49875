"""bench-serve's clients: one streamed request read to its end (a `Reply`), closed-loop users, the reference
outputs of the target alone, and the engine's step counters read from a server's /metrics. The scenario
(benchmarks/scenario.py) compares outputs with the same `reply_text`."""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field

import httpx

from adaptive_spec.outputs.prompts import PromptItem
from service.metrics import PREFIX


@dataclass
class Reply:
    prompt: int  # index into the prompts
    sent: float
    ttft_s: float | None = None
    latency_s: float = math.nan
    tokens: int = 0
    text: str = ""
    status: int | None = None  # None: a transport failure
    error: str = ""
    spec: dict = field(default_factory=dict)  # the response's usage.spec_decode


def _body(item: PromptItem, model: str, max_tokens: int, speculative: bool, stream: bool) -> tuple[str, dict]:
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        "adaptive_spec": {"speculative": speculative, "log": False},
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    body |= item.request_fields()  # response_format, tools, tool_choice
    if isinstance(item.prompt, str):
        return "/v1/completions", {**body, "prompt": item.prompt}
    return "/v1/chat/completions", {**body, "messages": item.prompt}


def reply_text(message: dict) -> str:
    """What a chat message (or a streamed delta) says, for comparing outputs: its content, then each
    tool call's name and arguments. A stream's deltas add up to the whole message's text."""
    text = message.get("content") or ""
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        text += (function.get("name") or "") + (function.get("arguments") or "")
    return text


async def model_name(client: httpx.AsyncClient, url: str) -> str:
    """The model a server serves, as its /v1/models names it."""
    return (await client.get(url + "/v1/models")).raise_for_status().json()["data"][0]["id"]


async def reference_texts(url: str, items: list[PromptItem], max_tokens: int) -> list[str]:
    async with httpx.AsyncClient(timeout=3600) as client:
        model = await model_name(client, url)
        texts = []
        for item in items:
            path, body = _body(item, model, max_tokens, speculative=False, stream=False)
            choice = (await client.post(url + path, json=body)).raise_for_status().json()["choices"][0]
            texts.append(reply_text(choice["message"]) if "message" in choice else choice["text"])
        return texts


async def closed_loop(
    url: str, items: list[PromptItem], users: int, duration_s: float, max_tokens: int, speculative: bool
) -> list[Reply]:
    """`users` closed-loop users for `duration_s`; requests under way at the end finish."""
    deadline = time.monotonic() + duration_s
    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=users + 2)) as client:
        model = await model_name(client, url)
        per_user = await asyncio.gather(
            *(_user(client, url, model, items, u, users, deadline, max_tokens, speculative) for u in range(users))
        )
    return [reply for replies in per_user for reply in replies]


async def _user(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    items: list[PromptItem],
    user: int,
    users: int,
    deadline: float,
    max_tokens: int,
    speculative: bool,
) -> list[Reply]:
    replies, n = [], 0
    while time.monotonic() < deadline:
        index = (user + n * users) % len(items)
        n += 1
        replies.append(await _one(client, url, model, items[index], index, max_tokens, speculative))
        if replies[-1].status is None:
            await asyncio.sleep(0.1)  # a refused connection returns at once: do not spin
    return replies


async def _one(
    client: httpx.AsyncClient, url: str, model: str, item: PromptItem, index: int, max_tokens: int, speculative: bool
) -> Reply:
    path, body = _body(item, model, max_tokens, speculative, stream=True)
    return await streamed(client, url + path, body, index)


async def streamed(client: httpx.AsyncClient, url: str, body: dict, index: int) -> Reply:
    """One streamed request to `url`, read to its end."""
    reply = Reply(index, time.monotonic())
    try:
        async with client.stream("POST", url, json=body) as response:
            reply.status = response.status_code
            if response.status_code != 200:
                reply.error = (await response.aread()).decode(errors="replace")[:300]
                return reply
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    reply.status, reply.error = 500, str(event["error"])[:300]
                    continue
                for choice in event.get("choices", []):
                    delta = reply_text(choice.get("delta", {})) if "delta" in choice else choice.get("text")
                    if delta:
                        if reply.ttft_s is None:
                            reply.ttft_s = time.monotonic() - reply.sent
                        reply.text += delta
                if event.get("usage"):
                    reply.tokens = event["usage"]["completion_tokens"]
                    reply.spec = event["usage"].get("spec_decode") or {}
    except httpx.HTTPError as exc:
        reply.status, reply.error = None, type(exc).__name__
    reply.latency_s = time.monotonic() - reply.sent
    return reply


def tpots_of(replies: list[Reply]) -> list[float]:
    """Each answered reply's time per output token after its first: (latency - ttft) / (tokens - 1)."""
    return [
        (r.latency_s - r.ttft_s) / (r.tokens - 1)
        for r in replies
        if r.status == 200 and r.ttft_s is not None and r.tokens > 1
    ]


async def step_counters(url: str) -> dict[str, float]:
    """The engine's step counters from /metrics: steps, rows decoded (sum of batch sizes), k drafted."""
    names = {
        PREFIX + "batch_steps_total": "steps",
        PREFIX + "batch_rows_total": "rows",
        PREFIX + "batch_draft_k_total": "k",
    }
    async with httpx.AsyncClient(timeout=30) as client:
        text = (await client.get(url + "/metrics")).text
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            found[names[name]] = float(value)
    return found
