"""The OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models.

    curl -s localhost:8000/v1/chat/completions -H 'content-type: application/json' -d '{
      "model": "smollm2-135m-instruct", "max_tokens": 64, "temperature": 0,
      "messages": [{"role": "user", "content": "Name three rivers."}],
      "adaptive_spec": {"domain": "geography"}}'

A request is checked (schema, model, limits, prompt length) before it is queued, so bad input
gets its 400 at once; then it waits for the engine thread (429 when the queue is full). With
`stream: true` the response starts once the first decoding step is done, so an error found
until then still gets its own status; after that, an error ends the stream with an
OpenAI-shaped `data: {"error": ...}` event and `data: [DONE]`.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from adaptive_spec.engine import InputError
from adaptive_spec.textstream import IncrementalText
from service.deps import ApiKey, ServiceDep
from service.errors import APIError, bad_request
from service.responses import CHAT, COMPLETION, Formatter, sse
from service.runtime import Service
from service.schemas import ChatRequest, CompletionRequest
from service.worker import Ended, Job, Rejected

router = APIRouter(prefix="/v1", tags=["openai"], dependencies=[ApiKey])


@router.get("/models")
async def list_models(service: ServiceDep) -> dict:
    engine = service.engine
    return {
        "object": "list",
        "data": [
            {
                "id": service.model_name,
                "object": "model",
                "created": service.started_at,
                "owned_by": "adaptive-spec",
                "max_model_len": engine.max_context,
                "draft": engine.draft_id,
                "adapter_version": engine.adapter_version,
            }
        ],
    }


@router.post("/chat/completions")
async def chat_completions(body: ChatRequest, request: Request, service: ServiceDep):
    return await _generate(service, request, body, [message.as_engine() for message in body.messages], CHAT)


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request, service: ServiceDep):
    return await _generate(service, request, body, body.prompt, COMPLETION)


async def _generate(service: Service, request: Request, body, prompt, kind: str):
    settings, engine = service.settings, service.engine
    if body.model != service.model_name:
        raise APIError(
            404,
            f"the model {body.model!r} does not exist; this server serves {service.model_name!r}",
            param="model",
            code="model_not_found",
        )
    max_tokens = body.requested_max_tokens or min(settings.default_max_tokens, settings.max_tokens_limit)
    if max_tokens > settings.max_tokens_limit:
        raise bad_request(
            f"max_tokens is {max_tokens}, over this server's limit of {settings.max_tokens_limit}", param="max_tokens"
        )
    if body.stop and engine.tokenizer is None:
        raise bad_request("stop strings need a tokenizer, and this model has none", param="stop")
    try:
        prompt_ids = await run_in_threadpool(engine.encode_prompt, prompt)
    except ValueError as exc:  # InputError, or a tokenizer without a chat template
        raise bad_request(str(exc), param="messages" if kind == CHAT else "prompt") from None

    options = body.adaptive_spec
    job = service.new_job(prompt_ids, body.engine_params(max_tokens), log_record=options.log, domain=options.domain)
    try:
        service.worker.submit(job)
    except Rejected as exc:
        service.metrics.requests_rejected.labels(exc.reason).inc()
        if exc.reason == "queue_full":
            raise APIError(
                429,
                f"the server is busy: {settings.queue_size} requests are already waiting; retry later",
                code="queue_full",
                headers={"Retry-After": "1"},
            ) from None
        raise APIError(503, "the server is shutting down", code="shutting_down") from None

    fmt = Formatter(
        kind,
        job.meta["request_id"],
        job.meta["created"],
        service.model_name,
        f"adaptive-spec:{engine.draft_id}:{engine.adapter_version or 'base'}",
    )
    headers = {"x-request-id": job.meta["request_id"]}
    chunk = await _next(job, request)
    if body.stream:
        events = _stream(job, chunk, fmt, IncrementalText(engine, body.stop), body.include_usage, len(prompt_ids))
        return StreamingResponse(
            events, media_type="text/event-stream", headers={**headers, "Cache-Control": "no-cache"}
        )
    while chunk.output is None:
        chunk = await _next(job, request)
    return JSONResponse(fmt.completion(chunk.output, len(prompt_ids)), headers=headers)


async def _next(job: Job, request: Request):
    """The job's next chunk while no response has started; watches for the client leaving."""
    try:
        return await job.next_event(request)
    except Ended as exc:
        raise _ended(exc) from None
    except asyncio.CancelledError:  # the server dropped the handler: the client is gone
        job.cancel("disconnect")
        raise


async def _stream(job: Job, chunk, fmt: Formatter, text: IncrementalText, include_usage: bool, prompt_tokens: int):
    """Server-sent events from the first chunk on. A client that leaves cancels this generator,
    whose `finally` stops the job at the next step."""
    try:
        if fmt.kind == CHAT:
            yield sse(fmt.chunk("", [], first=True, with_usage_field=include_usage))
        while chunk.output is None:
            delta = text.push(chunk.token_ids)
            if delta or fmt.kind == COMPLETION:
                yield sse(fmt.chunk(delta, chunk.token_ids, with_usage_field=include_usage))
            chunk = await job.next_event()
        output = chunk.output
        yield sse(
            fmt.chunk(text.finish(output.text), chunk.token_ids, output.finish_reason, with_usage_field=include_usage)
        )
        if include_usage:
            yield sse(fmt.usage_chunk(output, prompt_tokens))
    except Ended as exc:
        yield sse(_ended(exc).body())
    except InputError as exc:
        yield sse(bad_request(str(exc)).body())
    except Exception as exc:  # already logged by the worker
        yield sse(
            APIError(500, f"internal error ({type(exc).__name__}); see the server log", code="internal_error").body()
        )
    finally:
        job.cancel("disconnect")  # no-op once the job has finished or ended
    yield sse("[DONE]")


def _ended(exc: Ended) -> APIError:
    if exc.reason == "timeout":
        return APIError(
            504,
            "the request took longer than this server's limit (ADAPTIVE_SPEC_REQUEST_TIMEOUT_S) and was stopped",
            code="request_timeout",
        )
    if exc.reason == "disconnect":
        return APIError(499, "the client closed the connection", code="client_closed")
    return APIError(503, "the server shut down before this request finished", code="shutting_down")
