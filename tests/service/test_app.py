"""The OpenAI-compatible HTTP service against live uvicorn servers on loopback, with tiny models.

Run: .venv/bin/python -m pytest tests/service/test_app.py -q   (CPU, about 20 s; starts its own Redis)

What must hold:

- the official `openai` client works unchanged, streaming or not, and `usage.spec_decode`
  carries the speculation figures;
- greedy output over HTTP is the target alone's, token for token (and, for chat, text for text,
  with stop strings cut as OpenAI does, streamed or not);
- every bad input gets a 4xx in OpenAI's error shape, never a 5xx;
- concurrent clients all get their own right answer; a full queue answers 429; a stuck request
  times out with 504; a client that leaves stops its generation; shutdown finishes what is in
  flight;
- a request that opts out of logging leaves no correction record, while a normal one leaves one.

A test makes the engine "stuck" by holding `engine.step_lock`, which every decoding step takes:
the worker then waits inside the request's first step for as long as the test wants.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import openai
import pytest
import torch
from polling import wait_for
from tiny import tiny_target
from tiny_chat import tiny_tokenizer

from adaptive_spec import Engine
from adaptive_spec.contracts import CORRECTION_STREAM, PAYLOAD_FIELD
from adaptive_spec.formats.record import CorrectionRecord
from service.app import create_app
from service.settings import Settings

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.redis]  # the module server logs to Redis

PROMPT = [5, 17, 33, 8, 5, 17, 33, 8, 5, 17]


def client(server, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key=kwargs.pop("api_key", "unused"), max_retries=0, timeout=30, **kwargs
    )


def model_name(server) -> str:
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


def idle(server) -> None:
    """Wait until the worker has finished its last job, after-request hooks (metrics, records) included."""

    def quiet():
        health = httpx.get(server.url + "/health").json()
        return health["requests_running"] == 0 and health["requests_waiting"] == 0

    wait_for(quiet, what="the engine worker to be idle")


def metric(server, name: str, **labels) -> float:
    """The sum of a Prometheus sample over the series matching `labels`."""
    total = 0.0
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        match = re.fullmatch(r"([^{\s]+)(?:\{(.*)\})? (\S+)", line)
        if line.startswith("#") or not match or match[1] != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match[2] or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match[3])
    return total


def assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


@contextmanager
def engine_stuck(engine):
    """Hold the step lock: the worker blocks inside its current request's next decoding step."""
    engine.step_lock.acquire()
    try:
        yield
    finally:
        engine.step_lock.release()


@pytest.fixture(scope="module")
def server(live_server, tiny_engine, redis_url):
    with live_server(tiny_engine, redis_url=redis_url) as server:
        yield server


@pytest.fixture(scope="module")
def chat_server(live_server, chat_engine):
    with live_server(chat_engine) as server:
        yield server


# ---------------------------------------------------------------- the openai client, greedy equality


def test_completion_equals_the_target_alone(server, tiny_engine):
    expected = tiny_engine.generate(PROMPT, max_new_tokens=24, speculative=False).token_ids
    response = client(server).completions.create(model=model_name(server), prompt=PROMPT, max_tokens=24, temperature=0)
    choice = response.choices[0]
    assert choice.model_extra["token_ids"] == expected
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(PROMPT) and response.usage.completion_tokens == 24
    spec = response.usage.model_extra["spec_decode"]
    assert set(spec) >= {"num_draft_tokens", "num_accepted_tokens", "mean_acceptance_length", "adapter_version"}
    assert 0 <= spec["num_accepted_tokens"] <= spec["num_draft_tokens"] and spec["num_draft_tokens"] > 0
    assert spec["mean_acceptance_length"] >= 1.0 and spec["adapter_version"] is None
    assert spec["num_verify_forwards"] > 0 and spec["num_drafts"] == spec["num_drafts_per_pos"][0]
    assert sum(spec["num_accepted_tokens_per_pos"]) == spec["num_accepted_tokens"]
    assert response.id.startswith("cmpl-") and response.model == model_name(server)


def test_speculative_false_is_the_target_alone(server, tiny_engine):
    expected = tiny_engine.generate(PROMPT, max_new_tokens=16, speculative=False).token_ids
    response = client(server).completions.create(
        model=model_name(server),
        prompt=PROMPT,
        max_tokens=16,
        temperature=0,
        extra_body={"adaptive_spec": {"speculative": False}},
    )
    assert response.choices[0].model_extra["token_ids"] == expected
    spec = response.usage.model_extra["spec_decode"]
    assert spec["num_draft_tokens"] == 0 and spec["mean_acceptance_length"] == 1.0


def test_streamed_completion_with_usage(server, tiny_engine):
    expected = tiny_engine.generate(PROMPT[:6], max_new_tokens=30, speculative=False).token_ids
    chunks = list(
        client(server).completions.create(
            model=model_name(server),
            prompt=PROMPT[:6],
            max_tokens=30,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = [t for chunk in chunks for choice in chunk.choices for t in choice.model_extra["token_ids"]]
    assert streamed == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == 30
    spec = final.usage.model_extra["spec_decode"]
    assert spec["num_accepted_tokens"] <= spec["num_draft_tokens"]


def test_raw_stream_ends_with_done(server):
    body = {"model": model_name(server), "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_sampling_with_a_seed_is_reproducible(server):
    def sample():
        response = client(server).completions.create(
            model=model_name(server),
            prompt=PROMPT,
            max_tokens=16,
            temperature=0.9,
            top_p=0.95,
            seed=7,
            extra_body={"top_k": 20},
        )
        return response.choices[0].model_extra["token_ids"]

    assert sample() == sample()


def test_chat_equals_the_target_alone_streamed_or_not(chat_server, chat_engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three rivers."}]
    expected = chat_engine.generate(messages, max_new_tokens=20, speculative=False)
    chat = client(chat_server).chat.completions
    response = chat.create(model="tiny-chat", messages=messages, max_tokens=20, temperature=0)
    assert response.choices[0].message.content == expected.text
    assert response.choices[0].message.role == "assistant"
    assert response.object == "chat.completion" and response.usage.completion_tokens == len(expected.token_ids)

    stream = chat.create(model="tiny-chat", messages=messages, max_tokens=20, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


def test_chat_stop_string_is_cut_streamed_or_not(chat_server, chat_engine):
    messages = [{"role": "user", "content": "Count to ten."}]
    full = chat_engine.generate(messages, max_new_tokens=24, speculative=False).text
    assert len(full) >= 8, f"pick a prompt with a longer greedy output than {full!r}"
    stop = full[4:6]  # two characters from the middle: the reply must end right before them
    want = full[: full.find(stop)]
    chat = client(chat_server).chat.completions
    response = chat.create(model="tiny-chat", messages=messages, max_tokens=24, temperature=0, stop=[stop])
    assert response.choices[0].message.content == want
    assert response.choices[0].finish_reason == "stop"
    chunks = list(
        chat.create(model="tiny-chat", messages=messages, max_tokens=24, temperature=0, stop=stop, stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want


# ---------------------------------------------------------------- models, health, metrics


def test_models_health_and_metrics(server, tiny_engine):
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == tiny_engine.target_id
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    # what decodes, measured at start: this fp32 eager engine's exactness check ran (exact.check)
    assert (health.json()["dtype"], health.json()["path"]) == ("fp32", "eager")
    assert health.json()["exact"] is tiny_engine.exactness.exact

    idle(server)
    drafted = metric(server, "adaptive_spec:spec_decode_num_draft_tokens_total")
    response = httpx.post(
        server.url + "/v1/completions",
        json={
            "model": tiny_engine.target_id,
            "prompt": PROMPT,
            "max_tokens": 20,
            "temperature": 0,
            "adaptive_spec": {"domain": "metrics-test", "log": False},
        },
    ).json()
    idle(server)
    spec = response["usage"]["spec_decode"]
    assert metric(server, "adaptive_spec:spec_decode_num_draft_tokens_total") == drafted + spec["num_draft_tokens"]
    assert (
        metric(
            server, "adaptive_spec:spec_decode_num_accepted_tokens_total", domain="metrics-test", adapter_version="base"
        )
        == spec["num_accepted_tokens"]
    )
    assert metric(server, "adaptive_spec:spec_decode_num_drafts_total", domain="metrics-test") == spec["num_drafts"]
    free = metric(server, "adaptive_spec:spec_decode_num_free_draft_tokens_total", domain="metrics-test")
    assert free == spec["num_free_draft_tokens"] <= spec["num_draft_tokens"]
    assert 'adaptive_spec:spec_decode_num_free_draft_tokens_total{adapter_version="base",domain="metrics-test"}' in (
        httpx.get(server.url + "/metrics").text
    )
    per_pos = metric(server, "adaptive_spec:spec_decode_num_accepted_tokens_per_pos_total", domain="metrics-test")
    assert per_pos == spec["num_accepted_tokens"]
    assert metric(server, "adaptive_spec:request_success_total", domain="metrics-test", finished_reason="length") == 1
    assert metric(server, "adaptive_spec:adapter_version") == 0
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "correction_log_records_written_total",
        "correction_log_records_dropped_total",
        "correction_log_queue_depth",
        "num_requests_waiting",
        "num_requests_running",
    ):
        assert f"adaptive_spec:{name}" in text


# ---------------------------------------------------------------- bad input: 4xx in OpenAI's shape

BAD_COMPLETIONS = [  # (what is wrong, body changes, status, param)
    ("missing model", {"model": None}, 400, "model"),
    ("missing prompt", {"prompt": None}, 400, "prompt"),
    ("prompt of the wrong type", {"prompt": {"text": "hi"}}, 400, "prompt"),
    ("empty prompt", {"prompt": []}, 400, "prompt"),
    ("token id outside the vocabulary", {"prompt": [1, 2, 100000]}, 400, "prompt"),
    ("prompt over the context", {"prompt": [3] * 300}, 400, "prompt"),
    ("batch of prompts", {"prompt": [[1, 2], [3, 4]]}, 400, "prompt"),
    ("text prompt without a tokenizer", {"prompt": "hello"}, 400, "prompt"),
    ("max_tokens zero", {"max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens over the limit", {"max_tokens": 201}, 400, "max_tokens"),
    ("max_completion_tokens over the limit", {"max_completion_tokens": 5000}, 400, "max_tokens"),
    ("max_tokens not a number", {"max_tokens": "ten"}, 400, "max_tokens"),
    ("temperature over 2", {"temperature": 2.5}, 400, "temperature"),
    ("negative temperature", {"temperature": -0.1}, 400, "temperature"),
    ("top_p zero", {"top_p": 0}, 400, "top_p"),
    ("top_p over 1", {"top_p": 1.5}, 400, "top_p"),
    ("n over 8", {"n": 9}, 400, "n"),
    ("stop strings without a tokenizer", {"stop": ["\n"]}, 400, "stop"),
    ("empty stop string", {"stop": [""]}, 400, "stop"),
    ("logprobs over 5", {"logprobs": 6}, 400, "logprobs"),
    ("stream_options without stream", {"stream_options": {"include_usage": True}}, 400, None),
    ("unknown adaptive_spec option", {"adaptive_spec": {"lgo": False}}, 400, "adaptive_spec.lgo"),
    ("bad domain tag", {"adaptive_spec": {"domain": "has spaces"}}, 400, "adaptive_spec.domain"),
    ("speculative not a bool", {"adaptive_spec": {"speculative": "no"}}, 400, "adaptive_spec.speculative"),
    ("stream not a boolean", {"stream": "yes"}, 400, "stream"),
]


@pytest.mark.parametrize("what, changes, status, param", BAD_COMPLETIONS, ids=[b[0] for b in BAD_COMPLETIONS])
def test_bad_completion_requests(server, what, changes, status, param):
    body = {"model": model_name(server), "prompt": PROMPT, "max_tokens": 4}
    body.update(changes)
    body = {k: v for k, v in body.items() if v is not None}
    assert_error(httpx.post(server.url + "/v1/completions", json=body), status, param)


BAD_CHATS = [
    ("empty messages", {"messages": []}, 400, "messages"),
    ("unknown role", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ("content not text", {"messages": [{"role": "user", "content": 7}]}, 400, "messages.0.content"),
    ("missing messages", {"messages": None}, 400, "messages"),
]


@pytest.mark.parametrize("what, changes, status, param", BAD_CHATS, ids=[b[0] for b in BAD_CHATS])
def test_bad_chat_requests(chat_server, what, changes, status, param):
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **changes}
    body = {k: v for k, v in body.items() if v is not None}
    assert_error(httpx.post(chat_server.url + "/v1/chat/completions", json=body), status, param)


def test_protocol_level_errors(server):
    url = server.url + "/v1/completions"
    assert_error(
        httpx.post(url, content=b'{"model": ', headers={"content-type": "application/json"}), 400, code="invalid_json"
    )
    assert_error(httpx.post(url), 400)
    big = b'{"prompt": "' + b"x" * (1 << 20) + b'"}'
    assert_error(httpx.post(url, content=big, headers={"content-type": "application/json"}), 413, code="body_too_large")
    chunked = iter([big[: 1 << 19], big[1 << 19 :]])  # no Content-Length: counted as it arrives
    assert_error(
        httpx.post(url, content=chunked, headers={"content-type": "application/json"}), 413, code="body_too_large"
    )
    assert_error(httpx.post(url, json={"model": "gpt-4", "prompt": PROMPT}), 404, "model", "model_not_found")
    assert_error(httpx.get(url), 405)
    assert_error(httpx.get(server.url + "/v1/nothing-here"), 404)


def test_chat_without_a_tokenizer_is_a_clear_400(server):
    error = assert_error(
        httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": model_name(server), "messages": [{"role": "user", "content": "hi"}]},
        ),
        400,
        "messages",
    )
    assert "tokenizer" in error["message"]


def test_openai_client_raises_its_own_error_types(server):
    with pytest.raises(openai.BadRequestError) as bad:
        client(server).completions.create(model=model_name(server), prompt=PROMPT, temperature=3)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client(server).completions.create(model="no-such-model", prompt=PROMPT)


# ---------------------------------------------------------------- concurrency and limits


def test_eight_concurrent_clients(server, tiny_engine):
    prompts = [[(7 * i + j) % 100 + 1 for j in range(4 + i)] for i in range(8)]
    expected = [tiny_engine.generate(p, max_new_tokens=12, speculative=False).token_ids for p in prompts]
    name = model_name(server)

    def ask(prompt):
        response = client(server).completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0)
        return response.choices[0].model_extra["token_ids"]

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(ask, prompts)) == expected


def post_in_background(url: str, body: dict, results: list, timeout: float = 30) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.append(httpx.post(url, json=body, timeout=timeout)))
    thread.start()
    return thread


def test_full_queue_answers_429(live_server, tiny_engine):
    with live_server(tiny_engine, queue_size=1) as server:
        url, body = server.url + "/v1/completions", {"model": tiny_engine.target_id, "prompt": PROMPT, "max_tokens": 8}
        results: list[httpx.Response] = []
        with engine_stuck(tiny_engine):
            running = post_in_background(url, body, results)
            wait_for(lambda: httpx.get(server.url + "/health").json()["requests_running"] == 1, what="running")
            waiting = post_in_background(url, body, results)
            wait_for(lambda: httpx.get(server.url + "/health").json()["requests_waiting"] == 1, what="queued")
            refused = httpx.post(url, json=body)
            assert_error(refused, 429, code="queue_full")
            assert refused.headers["retry-after"] == "1"
        running.join(), waiting.join()
        assert [r.status_code for r in results] == [200, 200]
        assert metric(server, "adaptive_spec:requests_rejected_total", reason="queue_full") == 1


def test_stuck_request_times_out(live_server, tiny_engine):
    with live_server(tiny_engine, request_timeout_s=1.0) as server:
        body = {"model": tiny_engine.target_id, "prompt": PROMPT, "max_tokens": 8}
        with engine_stuck(tiny_engine):
            started = time.monotonic()
            assert_error(httpx.post(server.url + "/v1/completions", json=body), 504, code="request_timeout")
            assert time.monotonic() - started < 3
        wait_for(
            lambda: metric(server, "adaptive_spec:requests_cancelled_total", reason="timeout") == 1,
            what="the worker to stop the timed-out request",
        )
        assert httpx.post(server.url + "/v1/completions", json=body).status_code == 200


def test_client_that_leaves_stops_its_generation(server, tiny_engine):
    url = server.url + "/v1/completions"
    cancelled = metric(server, "adaptive_spec:requests_cancelled_total", reason="disconnect")
    body = {"model": tiny_engine.target_id, "prompt": PROMPT, "max_tokens": 200}
    with engine_stuck(tiny_engine):  # waiting for its first step, the client gives up
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json=body, timeout=0.5)
        time.sleep(0.5)  # the handler polls for a disconnect every 0.25 s
    wait_for(
        lambda: metric(server, "adaptive_spec:requests_cancelled_total", reason="disconnect") == cancelled + 1,
        what="the non-streaming request to be cancelled",
    )

    with httpx.stream("POST", url, json={**body, "stream": True}) as response:
        assert next(response.iter_lines()).startswith("data: ")
        tiny_engine.step_lock.acquire()  # mid-stream: the next step waits until the client is gone
    time.sleep(0.3)
    tiny_engine.step_lock.release()
    wait_for(
        lambda: metric(server, "adaptive_spec:requests_cancelled_total", reason="disconnect") == cancelled + 2,
        what="the streaming request to be cancelled",
    )
    assert httpx.get(server.url + "/health").json()["requests_running"] == 0


def test_shutdown_finishes_in_flight_requests(live_server, tiny_engine, redis_url, redis_client):
    with live_server(tiny_engine, redis_url=redis_url) as server:
        results: list[httpx.Response] = []
        body = {"model": tiny_engine.target_id, "prompt": PROMPT, "max_tokens": 8}
        with engine_stuck(tiny_engine):
            request = post_in_background(server.url + "/v1/completions", body, results)
            wait_for(lambda: httpx.get(server.url + "/health").json()["requests_running"] == 1, what="running")
            server.server.should_exit = True  # what SIGTERM does
            time.sleep(0.3)
        request.join()
        server.thread.join(30)
        assert not server.thread.is_alive()
        assert results[0].status_code == 200
    assert redis_client.xlen(CORRECTION_STREAM) == 1  # the writer was closed after the request, not before


def test_draining_server_answers_503(live_server, tiny_engine):
    with live_server(tiny_engine) as server:
        server.service.worker.close(timeout=1.0)  # what the lifespan does first at shutdown
        body = {"model": tiny_engine.target_id, "prompt": PROMPT, "max_tokens": 4}
        assert_error(httpx.post(server.url + "/v1/completions", json=body), 503)
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"


def test_a_draft_with_nan_weights_answers_every_request_with_the_targets_tokens(live_server):
    """A NaN in the draft's weights made its probabilities NaN: torch.multinomial raised, and every row of
    that step got a 500. Now each row drafts nothing and the target decodes it: 200, its exact tokens."""
    engine = Engine(tiny_target(0), "early-exit:1", tokenizer=tiny_tokenizer(), target_id="tiny-chat", record_topk=8)
    with torch.no_grad():
        next(engine.drafter.model.model.layers[0].parameters()).fill_(float("nan"))
    plain = Engine(tiny_target(0), None)
    samplings = [(0.0, None), (1.0, 1), (0.8, 2), (1.0, 3), (0.0, None), (1.2, 4)]

    def complete(sampling: tuple[float, int | None]) -> httpx.Response:
        body = {
            "model": "tiny-chat",
            "prompt": PROMPT,
            "max_tokens": 12,
            "temperature": sampling[0],
            "seed": sampling[1],
        }
        return httpx.post(server.url + "/v1/completions", timeout=60, json=body)

    with live_server(engine) as server, ThreadPoolExecutor(len(samplings)) as pool:  # they share batch steps
        responses = list(pool.map(complete, samplings))
    for (temperature, seed), response in zip(samplings, responses, strict=True):
        assert response.status_code == 200, response.text
        expected = plain.generate(PROMPT, 12, temperature=temperature, seed=seed, speculative=False).token_ids
        assert response.json()["choices"][0]["token_ids"] == expected
        assert response.json()["usage"]["spec_decode"]["num_draft_tokens"] == 0


# ---------------------------------------------------------------- liveness: threads that die


def test_when_the_engine_thread_dies_health_is_503_and_its_requests_end_at_once(live_server, tiny_engine, caplog):
    """Before: the engine thread's Future was dropped, so what killed it was never logged, /health stayed
    200, and every request waited for its timeout (504). Killed here by a fault its loop does not catch
    (its own bookkeeping raising) with one request decoding and one queued."""
    with live_server(tiny_engine, request_timeout_s=120.0) as server:
        worker, url = server.service.worker, server.url + "/v1/completions"
        body = {"model": tiny_engine.target_id, "prompt": PROMPT, "max_tokens": 8}
        results: list[httpx.Response] = []
        with engine_stuck(tiny_engine):
            running = post_in_background(url, body, results, timeout=100)
            wait_for(lambda: httpx.get(server.url + "/health").json()["requests_running"] == 1, what="running")
            queued = post_in_background(url, body, results, timeout=100)
            wait_for(lambda: httpx.get(server.url + "/health").json()["requests_waiting"] == 1, what="queued")

            def broken(batch) -> None:
                raise RuntimeError("injected: the worker's own bookkeeping failed")

            worker._drop_stopped = broken  # runs after the step the lock holds back
            started = time.monotonic()
        running.join(), queued.join()
        ended_s = time.monotonic() - started
        health = httpx.get(server.url + "/health")
        refused = httpx.post(url, json=body)
    print(f"\nengine thread killed: both requests answered {[r.status_code for r in results]} in {ended_s:.2f} s")
    assert [r.json()["error"]["code"] for r in results] == ["engine_dead", "engine_dead"]
    assert all(r.status_code == 503 for r in results) and ended_s < 60  # not the 120 s timeout's 504
    assert health.status_code == 503 and health.json()["status"] == "unhealthy"
    assert health.json()["dead"] == ["engine"] and health.json()["threads"]["engine"] is False
    assert_error(refused, 503, code="engine_dead")
    died = [r for r in caplog.records if "engine worker died" in r.getMessage()]
    assert died and died[0].exc_info is not None and "injected" in str(died[0].exc_info[1])
    assert isinstance(worker.died, RuntimeError)


def test_a_dead_correction_log_writer_is_reported_and_serving_goes_on(live_server, tiny_engine, redis_url, caplog):
    """The writer matters to the loop, not to serving (service/routers/ops.py says why): /health stays
    200, says `correction_log: false`, and records are dropped and counted as while Redis is away."""
    with live_server(tiny_engine, redis_url=redis_url, log_queue_size=2) as server:
        writer = server.service.writer

        def write(batch) -> list[bytes]:
            raise SystemExit("injected: a library called sys.exit on the writer's thread")

        writer._write = write  # a fault its retry loop does not catch
        body = {"model": tiny_engine.target_id, "prompt": PROMPT, "max_tokens": 4}
        statuses = {httpx.post(server.url + "/v1/completions", json=body).status_code for _ in range(5)}
        wait_for(lambda: not writer.alive, what="the writer to die")
        health = httpx.get(server.url + "/health")
        counts = health.json()["correction_log"]
    print(f"\ncorrection-log writer killed: requests {statuses}, /health {health.status_code}, writer {counts}")
    assert statuses == {200}
    assert health.status_code == 200 and health.json()["threads"]["correction_log"] is False
    assert counts["dropped"] >= 3 and counts["written"] == 0  # a queue of 2: the rest dropped, counted
    died = [r for r in caplog.records if "correction-log writer died" in r.getMessage()]
    assert died and died[0].exc_info is not None


# ---------------------------------------------------------------- privacy and the correction log


def test_opted_out_request_leaves_no_record(server, tiny_engine, redis_client):
    idle(server)
    assert server.service.writer.flush(5)
    redis_client.flushdb()  # records of the earlier tests
    url = server.url + "/v1/completions"
    body = {"model": tiny_engine.target_id, "prompt": PROMPT, "max_tokens": 10, "temperature": 0}
    opted_out = httpx.post(url, json={**body, "adaptive_spec": {"log": False, "domain": "private"}})
    logged = httpx.post(url, json={**body, "adaptive_spec": {"domain": "sql"}})
    assert opted_out.status_code == logged.status_code == 200
    entries = wait_for(lambda: redis_client.xrange(CORRECTION_STREAM), what="the record in Redis")
    time.sleep(0.2)  # a record of the opted-out request would have been written first
    entries = redis_client.xrange(CORRECTION_STREAM)
    assert len(entries) == 1
    record = CorrectionRecord.decode(entries[0][1][PAYLOAD_FIELD.encode()])
    assert record.request_id == logged.headers["x-request-id"] == logged.json()["id"].removeprefix("cmpl-")
    assert record.domain == "sql" and record.prompt_ids == PROMPT
    assert record.output_ids == logged.json()["choices"][0]["token_ids"]
    assert record.target_topk_ids.shape == (10, 8) and record.draft_id == "early-exit:1"


def test_requests_keep_a_top_m_only_where_a_record_is_written(server, tiny_engine, live_server):
    requests = tiny_engine.requests(PROMPT, 2, max_new_tokens=4)

    def recorded(service, log_record: bool) -> list[bool]:
        async def new_job():  # a job belongs to the event loop it is made on
            return service.new_job(requests, log_record=log_record)

        return [request.record for request in asyncio.run(new_job()).requests]

    assert recorded(server.service, True) == [True, True]
    assert recorded(server.service, False) == [False, False]  # opted out
    with live_server(tiny_engine) as unlogged:  # no Redis: no correction log
        assert unlogged.service.writer is None
        assert recorded(unlogged.service, True) == [False, False]


# ---------------------------------------------------------------- settings and keys


def test_api_key_guards_v1_only(live_server, tiny_engine):
    with live_server(tiny_engine, api_key="s3cret-key-7c41e09d") as server:
        body = {"model": tiny_engine.target_id, "prompt": PROMPT, "max_tokens": 4}
        assert_error(httpx.post(server.url + "/v1/completions", json=body), 401, code="invalid_api_key")
        assert_error(httpx.get(server.url + "/v1/models", headers={"authorization": "Bearer nope"}), 401)
        response = client(server, api_key="s3cret-key-7c41e09d").completions.create(**body)
        assert len(response.choices[0].model_extra["token_ids"]) == 4
        assert httpx.get(server.url + "/health").status_code == 200
        assert httpx.get(server.url + "/metrics").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            client(server, api_key="wrong").models.list()


def test_creating_the_app_loads_no_model():
    app = create_app(Settings(target="/no/such/model.gguf"))  # would fail at once if it loaded anything
    assert app.state.service is None


def test_settings_from_the_environment_hide_secrets():
    environ = {
        "ADAPTIVE_SPEC_PORT": "9001",
        "ADAPTIVE_SPEC_K": "3",
        "ADAPTIVE_SPEC_MAX_TOKENS": "64",
        "REDIS_URL": "redis://:hunter2@localhost:6379/0",
        "ADAPTIVE_SPEC_API_KEY": "key-123-a8c2e4f1",
        "ADAPTIVE_SPEC_ADMIN_TOKEN": "tok-456-b93d07e2",
    }
    settings = Settings.from_env(environ, host="0.0.0.0")
    assert (settings.port, settings.k, settings.max_tokens_limit, settings.host) == (9001, 3, 64, "0.0.0.0")
    assert settings.redis_url == "redis://:hunter2@localhost:6379/0"
    shown = repr(settings)
    assert "hunter2" not in shown and "key-123-a8c2e4f1" not in shown and "tok-456-b93d07e2" not in shown
    assert "redis://***@localhost:6379/0" in shown
    assert Settings.from_env({}).k is None and Settings.from_env({"ADAPTIVE_SPEC_K": "dynamic"}).k is None
    read_from_files = Settings.from_env(
        {"ADAPTIVE_SPEC_ADMIN_TOKEN": "tok-456-b93d07e2\n", "ADAPTIVE_SPEC_API_KEY": " key-123-a8c2e4f1\n"}
    )
    assert (read_from_files.admin_token, read_from_files.api_key) == (
        "tok-456-b93d07e2",
        "key-123-a8c2e4f1",
    )  # as clients send them
    with pytest.raises(ValueError, match="admin_token is blank"):
        Settings(admin_token=" \n")  # not silently "no token", which would open /v1 for an API key
    with pytest.raises(ValueError, match="ADAPTIVE_SPEC_PORT"):
        Settings.from_env({"ADAPTIVE_SPEC_PORT": "eighty"})


def test_the_models_load_on_the_thread_that_decodes(live_server, tmp_path):
    """torch's OpenMP workers belong to the thread that ran a parallel region: a model loaded on one
    live thread and decoded on another ran at half speed (service/worker.py). So the lifespan loads
    the models on the engine thread, and the worker decodes on that same thread."""
    tiny_target(0).save_pretrained(tmp_path / "model")
    tiny_tokenizer().save_pretrained(tmp_path / "model")
    with live_server(None, target=str(tmp_path / "model"), draft="early-exit:1", device="cpu") as server:
        service = server.service
        stepped_on = set()
        on_step = service.worker.on_step
        service.worker.on_step = lambda *step: (stepped_on.add(threading.get_ident()), on_step(*step))
        body = {"model": service.model_name, "prompt": "hello", "max_tokens": 4}
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200
        assert stepped_on == {service.engine._home_thread} != {threading.get_ident()}


def test_a_server_stopped_while_loading_gives_up_the_load_and_stops_what_it_started(monkeypatch):
    """A signal during the load (service/server.py wires `stop_requested` to uvicorn's): the lifespan
    gives up at once, serving nothing, and a load that ends later stops the service it started instead of
    leaving its threads running."""
    from service import app as app_module  # the module whose Service.start the lifespan calls

    release, stopped = threading.Event(), threading.Event()

    class Started:
        def stop(self):
            stopped.set()

    def slow_start(settings, engine):
        release.wait(30)
        return Started()

    monkeypatch.setattr(app_module.Service, "start", staticmethod(slow_start))
    app = app_module.create_app(Settings())
    asked = threading.Event()
    app.state.stop_requested = asked.is_set

    async def startup_then_signal():
        started = time.monotonic()
        task = asyncio.ensure_future(app.router.lifespan_context(app).__aenter__())
        await asyncio.sleep(0.5)
        assert not task.done()  # still loading
        asked.set()
        await asyncio.wait_for(task, 5)
        return time.monotonic() - started

    elapsed = asyncio.run(startup_then_signal())
    assert elapsed < 3 and app.state.stopped_while_loading and app.state.service is None
    assert not stopped.is_set()
    release.set()  # the load ends after the server gave up on it
    assert stopped.wait(5), "the service started by the abandoned load kept running"
