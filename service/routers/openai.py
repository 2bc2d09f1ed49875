"""The OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models.

    curl -s localhost:8000/v1/chat/completions -H 'content-type: application/json' -d '{
      "model": "smollm2-135m-instruct", "max_tokens": 64, "temperature": 0,
      "messages": [{"role": "user", "content": "Name three rivers."}],
      "adaptive_spec": {"domain": "geography"}}'

A request is checked (schema, model, limits, prompt length, and by the engine itself: penalties,
logit bias, a response_format's schema, compiled here) before it is queued, so bad input gets its
400 at once; then it waits for the engine thread. The 429 (queue full) comes first of all, before the
prompt is tokenised and a grammar compiled: a place in the queue is reserved, and given back if the
request turns out bad. Its `n` choices
decode as n rows of the batch that share one prefill. With `stream: true` the response starts
once the first decoding step is done, so an error found until then still gets its own status;
after that, an error ends the stream with an OpenAI-shaped `data: {"error": ...}` event and
`data: [DONE]`. The n choices' chunks interleave, each with its `index`, and one `[DONE]` follows
the last choice's end.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from adaptive_spec.decoding.request import Request as EngineRequest
from adaptive_spec.engine import Chunk, Engine, GenerationOutput, InputError
from adaptive_spec.outputs.textstream import IncrementalText
from adaptive_spec.outputs.tokens import encode_prompt
from adaptive_spec.outputs.tools import ToolCallStream
from adaptive_spec.outputs.tools.use import ToolUse
from service.deps import ApiKey, ServiceDep
from service.errors import APIError, bad_request
from service.responses import CHAT, COMPLETION, Formatter, Logprobs, sse, token_text, tool_calls_finish
from service.runtime import Service
from service.schemas import ChatRequest, CompletionRequest
from service.tool_calls import tool_use
from service.worker import Ended, Job, Rejected

router = APIRouter(prefix="/v1", tags=["openai"], dependencies=[ApiKey])

# Engine.request's parameters whose name starts its InputError message: the error's `param`.
_ENGINE_PARAMS = (
    "response_format",
    "logit_bias",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "logprobs",
    "top_k",
    "top_p",
    "temperature",
    "stop",
    "max_new_tokens",
)


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
    messages = [message.as_engine() for message in body.messages]
    calling = tool_use(body, service.settings.tool_call_parser)  # None: no tools, no tool turns
    if calling is None:
        return await _generate(service, request, body, messages, CHAT)
    messages, tools = calling.prompt(messages, service.engine.tokenizer)
    return await _generate(service, request, body, messages, CHAT, calling, tools)


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request, service: ServiceDep):
    return await _generate(service, request, body, body.prompt, COMPLETION)


async def _generate(
    service: Service,
    request: Request,
    body,
    prompt,
    kind: str,
    calling: ToolUse | None = None,
    tools: list[dict] | None = None,
):
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
    if body.num_choices > settings.max_batch:
        raise bad_request(
            f"n is {body.num_choices}, over this server's batch of {settings.max_batch} rows "
            "(ADAPTIVE_SPEC_MAX_BATCH): the n choices decode together",
            param="n",
        )
    if body.stop and engine.tokenizer is None:
        raise bad_request("stop strings need a tokenizer, and this model has none", param="stop")
    params = body.engine_params(max_tokens)
    forced = calling is not None and calling.forced
    if forced:
        params["response_format"] = calling.response_format(engine.json_whitespace)
    place = _admit(service)  # the 429 comes before tokenisation and grammar compiling, which cost the most
    try:
        options = body.adaptive_spec
        requests = await run_in_threadpool(
            _checked,
            engine,
            prompt,
            {**params, "domain": options.domain, "streamed": bool(body.stream)},
            body.num_choices,
            "messages" if kind == CHAT else "prompt",
            tools,
            forced,
        )
        job = service.new_job(requests, log_record=options.log)
        _submit(service, lambda: service.worker.submit(job, place))
    finally:
        place.release()  # a bad request gives its place back; submit has taken it otherwise

    fmt = Formatter(
        kind,
        job.meta["request_id"],
        job.meta["created"],
        service.model_name,
        f"adaptive-spec:{engine.draft_id}:{engine.adapter_version or 'base'}",
        token_text(engine.tokenizer),
        tool_reader=None if calling is None else calling.reader,
    )
    headers = {"x-request-id": job.meta["request_id"]}
    chunk = await _next(job, request)
    if body.stream:
        choices = [
            _Choice(index, fmt, IncrementalText(engine, body.stop), params["logprobs"], fmt.tool_calls_reader())
            for index in range(job.n)
        ]
        events = _stream(job, chunk, fmt, choices, body.include_usage, job.prompt_tokens)
        return StreamingResponse(
            events, media_type="text/event-stream", headers={**headers, "Cache-Control": "no-cache"}
        )
    outputs: dict[int, GenerationOutput] = {}
    while True:
        if chunk.output is not None:
            outputs[chunk.index] = chunk.output
            if len(outputs) == job.n:
                break
        chunk = await _next(job, request)
    ordered = [outputs[index] for index in range(job.n)]
    return JSONResponse(fmt.completion(ordered, job.prompt_tokens), headers=headers)


def _admit(service: Service):
    """A place in the engine's queue (service/worker.py `reserve`), or the 429 / 503 at once."""
    return _submit(service, service.worker.reserve)


def _submit(service: Service, call):
    try:
        return call()
    except Rejected as exc:
        service.metrics.requests_rejected.labels(exc.reason).inc()
        if exc.reason == "queue_full":
            raise APIError(
                429,
                f"the server is busy: {service.settings.queue_size} requests are already waiting; retry later",
                code="queue_full",
                headers={"Retry-After": "1"},
            ) from None
        if exc.reason == "engine_dead":
            raise _ended(Ended(exc.reason)) from None
        raise APIError(503, "the server is shutting down", code="shutting_down") from None


def _checked(
    engine: Engine,
    prompt,
    params: dict,
    n: int,
    prompt_param: str,
    tools: list[dict] | None = None,
    forced: bool = False,
) -> list[EngineRequest]:
    """The engine's requests for the `n` choices, built once here and queued as they are: a bad
    value, or a response_format (or a forced tool call's grammar) the grammar library cannot
    compile, is a 400 before anything is queued. Runs on a worker thread, not the event loop.
    `tools` go to the chat template (service/tool_calls.py)."""
    try:
        if tools:
            prompt_ids = encode_prompt(prompt, engine.tokenizer, engine.vocab_size, engine.max_context, tools=tools)
        else:
            prompt_ids = engine.encode_prompt(prompt)
    except ValueError as exc:  # InputError, or a tokenizer without a chat template
        raise bad_request(str(exc), param=prompt_param) from None
    try:
        return engine.requests(prompt_ids, n, **params)
    except InputError as exc:
        message = str(exc)
        if forced and message.startswith("response_format"):  # the grammar is the tools' schemas
            raise bad_request("tools" + message.removeprefix("response_format"), param="tools") from None
        raise bad_request(message, param=next((p for p in _ENGINE_PARAMS if message.startswith(p)), None)) from None
    except ValueError as exc:
        if params.get("response_format") is None:
            raise
        # llguidance could not read this model's tokenizer (it raises before the engine can tell).
        raise bad_request(
            f"response_format is not available for this model: the grammar library cannot read its tokenizer ({exc})",
            param="response_format",
        ) from None


async def _next(job: Job, request: Request):
    """The job's next chunk while no response has started; watches for the client leaving."""
    try:
        return await job.next_event(request)
    except Ended as exc:
        raise _ended(exc) from None
    except asyncio.CancelledError:  # the server dropped the handler: the client is gone
        job.cancel("disconnect")
        raise


@dataclass
class _Choice:
    """What the stream of one choice has shown so far.

    With log-probabilities asked, a choice's chunks wait for its output, which carries them (the
    engine's `Chunk` holds token ids only); each is then sent as it would have been, with its own
    tokens' log-probabilities. Without, every chunk goes out as soon as it comes.
    """

    index: int
    fmt: Formatter
    text: IncrementalText
    logprobs: int | None  # as asked of the engine: None = none
    calls: ToolCallStream | None = None  # reads tool calls out of the text (service/tool_calls.py)
    tokens_shown: int = 0
    text_offset: int = 0  # characters of the tokens shown so far (completions' text_offset)
    held: list[Chunk] = field(default_factory=list)

    def events(self, chunk: Chunk, include_usage: bool) -> list[dict]:
        """The bodies to send now that `chunk` came; the last one of a choice has its finish_reason."""
        self.held.append(chunk)
        if self.logprobs is not None and chunk.output is None:
            return []
        output, held, self.held = chunk.output, self.held, []
        bodies = []
        for step in held:
            logprobs = None
            if self.logprobs is not None:
                start = self.tokens_shown
                logprobs = Logprobs.of(output, start, start + len(step.token_ids), self.text_offset)
                self.text_offset += sum(len(self.fmt.tokens(token)[0]) for token in step.token_ids)
            self.tokens_shown += len(step.token_ids)
            tool_calls: list[dict] = []
            if step.output is None:
                delta = self.text.push(step.token_ids)
                if self.calls is not None:
                    read = self.calls.push(delta)
                    delta, tool_calls = read.content, read.tool_calls
                if not delta and not tool_calls and self.fmt.kind == CHAT and logprobs is None:
                    continue  # nothing to show yet (a character or a stop string still incomplete)
                finish = None
            else:
                delta, finish = self.text.finish(step.output.text), step.output.finish_reason
                if self.calls is not None:
                    read = self.calls.finish(delta)
                    delta, tool_calls = read.content, read.tool_calls
                    finish = tool_calls_finish(finish, self.calls.calls)
            bodies.append(
                self.fmt.chunk(
                    self.index,
                    delta,
                    step.token_ids,
                    finish,
                    logprobs=logprobs,
                    with_usage_field=include_usage,
                    tool_calls=tool_calls,
                )
            )
        return bodies


async def _stream(
    job: Job, chunk: Chunk, fmt: Formatter, choices: list[_Choice], include_usage: bool, prompt_tokens: int
):
    """Server-sent events from the first chunk on, the n choices interleaved as their chunks come;
    one [DONE] once every choice has finished. A client that leaves cancels this generator, whose
    `finally` stops the job (all its choices) at the next step."""
    outputs: dict[int, GenerationOutput] = {}
    try:
        if fmt.kind == CHAT:
            for choice in choices:
                yield sse(fmt.chunk(choice.index, "", [], first=True, with_usage_field=include_usage))
        while True:
            for body in choices[chunk.index].events(chunk, include_usage):
                yield sse(body)
            if chunk.output is not None:
                outputs[chunk.index] = chunk.output
                if len(outputs) == len(choices):
                    break
            chunk = await job.next_event()
        if include_usage:
            yield sse(fmt.usage_chunk([outputs[index] for index in range(len(choices))], prompt_tokens))
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
    if exc.reason == "engine_dead":
        return APIError(
            503,
            "this server's engine stopped (see its log and GET /health); retry on another replica",
            code="engine_dead",
        )
    return APIError(503, "the server shut down before this request finished", code="shutting_down")
