"""Structured outputs, log-probabilities, n choices and penalties over HTTP, with the official
`openai` client, on tiny models (the real-model checks are in test_openai_features_real.py).

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/service/test_openai_features.py -q   (CPU, ~1 min)

What must hold:

- `response_format` (json_object, json_schema) gives output that parses and validates, greedy
  identical with and without speculation, streamed or not; a schema the grammar library cannot
  compile is a 400 carrying its message, and so is a tokenizer it cannot read;
- `logprobs` / `top_logprobs` come in OpenAI's shape for chat and completions, streamed and not,
  with the target alone's values, the same with and without speculation;
- `n` gives n choices, each with its index; with a seed they repeat, choice 0 is the n=1 answer,
  a stream interleaves them and ends once with [DONE], usage sums them, and each leaves its own
  correction record;
- penalties and `logit_bias` (and the `repetition_penalty` extension) give the target alone's
  greedy output under the same penalties;
- every bad value is a 400 in OpenAI's error shape naming the parameter.
"""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest
from polling import wait_for
from tiny import tiny_target
from tiny_bytes import tiny_byte_tokenizer

from adaptive_spec import Engine
from adaptive_spec.contracts import CORRECTION_STREAM, PAYLOAD_FIELD
from adaptive_spec.formats.record import CorrectionRecord

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.redis]

PROMPT = [5, 17, 33, 8, 5, 17, 33, 8, 5, 17]
MESSAGES = [{"role": "user", "content": "Give me a record."}]
POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 99}, "label": {"enum": ["near", "far"]}},
    "required": ["x", "label"],
    "additionalProperties": False,
}
NOT_SPECULATIVE = {"adaptive_spec": {"speculative": False}}


@pytest.fixture(scope="module")
def json_engine() -> Engine:
    """The tiny target with a byte-level tokenizer that llguidance reads; k = 3 drafts every step."""
    return Engine(
        tiny_target(0), "early-exit:1", tokenizer=tiny_byte_tokenizer(), target_id="tiny-json", k=3, record_topk=8
    )


@pytest.fixture(scope="module")
def server(live_server, tiny_engine, redis_url):
    with live_server(tiny_engine, redis_url=redis_url) as server:
        yield server


@pytest.fixture(scope="module")
def json_server(live_server, json_engine):
    with live_server(json_engine) as server:
        yield server


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "record", "schema": schema}}


def chat(server, stream: bool = False, **kwargs):
    """A chat completion, or the list of its stream's chunks."""
    kwargs = {"model": "tiny-json", "messages": MESSAGES, "max_tokens": 40, "temperature": 0, **kwargs}
    response = client(server).chat.completions.create(stream=stream, **kwargs)
    return list(response) if stream else response


def completion(server, model: str, stream: bool = False, **kwargs):
    kwargs = {"model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, **kwargs}
    response = client(server).completions.create(stream=stream, **kwargs)
    return list(response) if stream else response


def streamed_content(chunks, index: int = 0) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == index)


# ---------------------------------------------------------------- structured outputs


TAGS = {
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 3}, "ok": {"type": "boolean"}},
    "required": ["tags", "ok"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("schema", [POINT, TAGS], ids=["point", "tags"])
def test_json_schema_output_validates_and_equals_the_target_alone(json_server, json_engine, schema):
    response_format = schema_format(schema)
    expected = json_engine.generate(MESSAGES, max_new_tokens=60, response_format=response_format, speculative=False)
    assert expected.finish_reason == "stop", "the schema should end within the budget"
    jsonschema.validate(json.loads(expected.text), schema)
    texts = set()
    for extra in ({}, NOT_SPECULATIVE):
        response = chat(json_server, max_tokens=60, response_format=response_format, extra_body=extra)
        assert response.choices[0].finish_reason == "stop"
        texts.add(response.choices[0].message.content)
        chunks = chat(json_server, stream=True, max_tokens=60, response_format=response_format, extra_body=extra)
        texts.add(streamed_content(chunks))
    assert texts == {expected.text}


def test_json_object_equals_the_target_alone(json_server, json_engine):
    """A random model fills an object's string for ever: the output is cut, but every prefix is the target's."""
    expected = json_engine.generate(
        MESSAGES, max_new_tokens=40, response_format={"type": "json_object"}, speculative=False
    )
    assert expected.text.startswith("{")
    for extra in ({}, NOT_SPECULATIVE):
        response = chat(json_server, response_format={"type": "json_object"}, extra_body=extra)
        assert response.choices[0].message.content == expected.text


def test_completions_take_response_format_too(json_server, json_engine):
    """The client's completions.create has no response_format (OpenAI's legacy API); vLLM takes it there too."""
    response_format = schema_format(POINT)
    response = completion(
        json_server, "tiny-json", prompt="A point: ", max_tokens=80, extra_body={"response_format": response_format}
    )
    choice = response.choices[0]
    expected = json_engine.generate("A point: ", max_new_tokens=80, response_format=response_format, speculative=False)
    assert choice.text == expected.text and choice.model_extra["token_ids"] == expected.token_ids
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.text), POINT)


def test_a_schema_the_library_cannot_compile_is_a_400_with_its_message(json_server):
    bad = schema_format({"type": "object", "not": {"required": ["x"]}})
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            chat(json_server, stream=stream, response_format=bad)
        error = caught.value.body
        assert "Unimplemented keys" in error["message"] and '"not"' in error["message"], error
        assert error["param"] == "response_format"


def test_response_format_with_a_tokenizer_the_library_cannot_read_is_a_400(live_server, chat_engine):
    """tiny_chat's character tokenizer decodes with Fuse, which llguidance refuses."""
    with live_server(chat_engine) as server:
        with pytest.raises(openai.BadRequestError) as caught:
            client(server).chat.completions.create(
                model="tiny-chat", messages=MESSAGES, max_tokens=8, response_format={"type": "json_object"}
            )
        assert caught.value.body["param"] == "response_format"
        assert "cannot read its tokenizer" in caught.value.body["message"]
        plain = client(server).chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=4)
        assert plain.choices[0].finish_reason in ("stop", "length")


# ---------------------------------------------------------------- log-probabilities


def test_chat_logprobs_are_the_targets_streamed_or_not_with_or_without_speculation(json_server, json_engine):
    expected = json_engine.generate(MESSAGES, max_new_tokens=24, speculative=False, logprobs=3)
    tokenizer = json_engine.tokenizer
    for extra in ({}, NOT_SPECULATIVE):
        response = chat(json_server, max_tokens=24, logprobs=True, top_logprobs=3, extra_body=extra)
        entries = response.choices[0].logprobs.content
        streamed = chat(json_server, stream=True, max_tokens=24, logprobs=True, top_logprobs=3, extra_body=extra)
        streamed_entries = [
            e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
        ]
        for got in (entries, streamed_entries):
            assert [e.logprob for e in got] == pytest.approx(expected.logprobs, abs=1e-5)
            assert [e.token for e in got] == [tokenizer.decode([t]) for t in expected.token_ids]
            assert b"".join(bytes(e.bytes) for e in got).decode() == tokenizer.decode(expected.token_ids)
            for entry, top in zip(got, expected.top_logprobs, strict=True):
                assert [a.token for a in entry.top_logprobs] == [tokenizer.decode([i]) for i, _ in top]
                assert [a.logprob for a in entry.top_logprobs] == pytest.approx([v for _, v in top], abs=1e-5)
        assert streamed_content(streamed) == response.choices[0].message.content == expected.text


def test_chat_logprobs_without_alternatives(json_server):
    response = chat(json_server, max_tokens=6, logprobs=True)
    entries = response.choices[0].logprobs.content
    assert len(entries) == response.usage.completion_tokens and all(e.top_logprobs == [] for e in entries)
    assert chat(json_server, max_tokens=6).choices[0].logprobs is None


def test_completion_logprobs_are_the_targets_streamed_or_not_with_or_without_speculation(server, tiny_engine):
    expected = tiny_engine.generate(PROMPT, max_new_tokens=16, speculative=False, logprobs=2)
    model = tiny_engine.target_id
    for extra in ({}, NOT_SPECULATIVE):
        whole = completion(server, model, logprobs=2, extra_body=extra).choices[0]
        chunks = completion(server, model, stream=True, logprobs=2, extra_body=extra)
        assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == expected.token_ids
        assert all(len(c.choices[0].logprobs.tokens) == len(c.choices[0].model_extra["token_ids"]) for c in chunks)
        for got in (whole.logprobs, *[c.choices[0].logprobs for c in chunks]):
            assert set(got.model_dump(exclude_none=True)) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        streamed = {
            key: [v for c in chunks for v in getattr(c.choices[0].logprobs, key)]
            for key in ("tokens", "token_logprobs", "top_logprobs")
        }
        for got in (whole.logprobs.model_dump(), streamed):
            assert got["tokens"] == [f"token_id:{t}" for t in expected.token_ids]  # no tokenizer: ids, as vLLM
            assert got["token_logprobs"] == pytest.approx(expected.logprobs, abs=1e-5)
            for alternatives, top, token, value in zip(
                got["top_logprobs"], expected.top_logprobs, expected.token_ids, expected.logprobs, strict=True
            ):
                want = {f"token_id:{i}": v for i, v in top}
                want.setdefault(f"token_id:{token}", value)  # the chosen token is always there
                assert alternatives == pytest.approx(want, abs=1e-5)


def test_a_streamed_request_is_marked_so_and_a_whole_one_is_not(server, tiny_engine, monkeypatch):
    """Request.streamed: at dynamic k a stream's first step is the target's alone (its first token as soon as
    plain decoding gives it); an answer sent whole drafts from its first step."""
    streamed, made = [], tiny_engine.requests

    def requests(*args, **kwargs):
        built = made(*args, **kwargs)
        streamed.extend(request.streamed for request in built)
        return built

    monkeypatch.setattr(tiny_engine, "requests", requests)
    completion(server, tiny_engine.target_id)
    completion(server, tiny_engine.target_id, stream=True)
    assert streamed == [False, True]


def test_completion_text_offsets_follow_the_text(json_server, json_engine):
    response = completion(json_server, "tiny-json", prompt="Hello", max_tokens=12, logprobs=0)
    logprobs = response.choices[0].logprobs
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    assert all(len(top) == 1 for top in logprobs.top_logprobs)  # logprobs=0: the chosen token only
    assert "".join(logprobs.tokens).startswith(response.choices[0].text)


# ---------------------------------------------------------------- n choices


def test_n_seeded_choices_repeat_and_choice_zero_is_the_single_answer(server, tiny_engine):
    sample = dict(temperature=1.0, seed=11, max_tokens=12)
    first, again = (completion(server, tiny_engine.target_id, n=3, **sample) for _ in range(2))
    ids = [c.model_extra["token_ids"] for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert ids == [c.model_extra["token_ids"] for c in again.choices]
    assert len(set(map(tuple, ids))) > 1, "three samples of a random model should differ"
    single = completion(server, tiny_engine.target_id, **sample).choices[0].model_extra["token_ids"]
    assert ids[0] == single
    assert first.usage.completion_tokens == sum(len(i) for i in ids)
    assert first.usage.prompt_tokens == len(PROMPT)
    spec = first.usage.model_extra["spec_decode"]
    assert spec["num_draft_tokens"] > 0 and spec["num_accepted_tokens"] <= spec["num_draft_tokens"]


def test_n_streamed_interleaves_every_choice_and_ends_once(server, tiny_engine):
    sample = dict(temperature=1.0, seed=5, max_tokens=10, n=4)
    whole = completion(server, tiny_engine.target_id, **sample)
    chunks = completion(server, tiny_engine.target_id, stream=True, stream_options={"include_usage": True}, **sample)
    per_choice = {i: [] for i in range(4)}
    finishes = {}
    for c in chunks[:-1]:
        (choice,) = c.choices
        per_choice[choice.index] += choice.model_extra["token_ids"]
        if choice.finish_reason is not None:
            finishes[choice.index] = choice.finish_reason
    assert per_choice == {c.index: c.model_extra["token_ids"] for c in whole.choices}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    body = {"model": tiny_engine.target_id, "prompt": PROMPT, "stream": True, **sample}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        events = [line for line in response.iter_lines() if line]
    assert events.count("data: [DONE]") == 1 and events[-1] == "data: [DONE]"


def test_n_chat_stream_starts_every_choice_with_its_role(json_server):
    chunks = chat(json_server, stream=True, n=2, temperature=1.0, seed=3, max_tokens=8)
    firsts = [c.choices[0] for c in chunks[:2]]
    assert [(f.index, f.delta.role) for f in firsts] == [(0, "assistant"), (1, "assistant")]
    whole = chat(json_server, n=2, temperature=1.0, seed=3, max_tokens=8)
    assert [streamed_content(chunks, i) for i in range(2)] == [c.message.content for c in whole.choices]


def test_n_with_logprobs_and_a_schema(json_server, json_engine):
    response = chat(
        json_server,
        n=3,
        temperature=1.0,
        seed=2,
        max_tokens=60,
        logprobs=True,
        top_logprobs=1,
        response_format=schema_format(POINT),
    )
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), POINT)
        assert b"".join(bytes(e.bytes) for e in choice.logprobs.content).decode().startswith(choice.message.content)


def test_each_choice_leaves_its_own_correction_record(server, tiny_engine, redis_client):
    response = httpx.post(
        server.url + "/v1/completions",
        json={
            "model": tiny_engine.target_id,
            "prompt": PROMPT,
            "max_tokens": 6,
            "n": 3,
            "temperature": 0.8,
            "seed": 1,
            "adaptive_spec": {"domain": "n-test"},
        },
    )
    assert response.status_code == 200, response.text
    request_id = response.headers["x-request-id"]

    def records():
        found = [CorrectionRecord.decode(f[PAYLOAD_FIELD.encode()]) for _, f in redis_client.xrange(CORRECTION_STREAM)]
        mine = {r.request_id: r for r in found if r.request_id.startswith(request_id)}
        return mine if len(mine) == 3 else None

    mine = wait_for(records, what="three correction records in Redis")
    for index, choice in enumerate(response.json()["choices"]):
        record = mine[request_id if index == 0 else f"{request_id}-{index}"]
        assert record.output_ids == choice["token_ids"] and record.domain == "n-test"
        assert record.prompt_ids == PROMPT


def cancelled_by_disconnect(server) -> float:
    lines = httpx.get(server.url + "/metrics").text.splitlines()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith("adaptive_spec:requests_cancelled_total{") and 'reason="disconnect"' in line
    )


def test_a_client_leaving_an_n_stream_stops_every_choice(server, tiny_engine):
    before = cancelled_by_disconnect(server)
    body = {"model": tiny_engine.target_id, "prompt": PROMPT, "max_tokens": 200, "n": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        assert next(response.iter_lines()).startswith("data: ")
        tiny_engine.step_lock.acquire()  # mid-stream: the next step waits until the client is gone
    time.sleep(0.3)
    tiny_engine.step_lock.release()
    wait_for(lambda: cancelled_by_disconnect(server) == before + 1, what="the n=3 stream to be cancelled once")
    wait_for(lambda: httpx.get(server.url + "/health").json()["requests_running"] == 0, what="no row left running")


def test_n_over_the_servers_batch_is_a_400(live_server, tiny_engine):
    with live_server(tiny_engine, max_batch=2) as server:
        response = httpx.post(
            server.url + "/v1/completions", json={"model": tiny_engine.target_id, "prompt": PROMPT, "n": 3}
        )
        assert response.status_code == 400 and response.json()["error"]["param"] == "n", response.text
        ok = httpx.post(
            server.url + "/v1/completions",
            json={"model": tiny_engine.target_id, "prompt": PROMPT, "n": 2, "max_tokens": 3},
        )
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


# ---------------------------------------------------------------- penalties and logit bias

PENALTIES = [
    {"frequency_penalty": 0.8},
    {"presence_penalty": 1.5, "logit_bias": {"3": 4.0, "40": -100}},
    {"frequency_penalty": -0.5, "repetition_penalty": 1.3},
    {"frequency_penalty": 2.0, "presence_penalty": -2.0, "repetition_penalty": 0.7, "logit_bias": {"11": 3}},
]


@pytest.mark.parametrize("penalties", PENALTIES, ids=["frequency", "presence+bias", "repetition", "all"])
def test_penalties_give_the_target_alones_greedy_output_under_them(server, tiny_engine, penalties):
    engine_penalties = dict(penalties)
    if "logit_bias" in penalties:
        engine_penalties["logit_bias"] = {int(t): float(b) for t, b in penalties["logit_bias"].items()}
    expected = tiny_engine.generate(PROMPT, max_new_tokens=24, speculative=False, **engine_penalties).token_ids
    plain = tiny_engine.generate(PROMPT, max_new_tokens=24, speculative=False).token_ids
    assert expected != plain, "the penalties should change this output"
    model = tiny_engine.target_id
    openai_fields = {k: v for k, v in penalties.items() if k != "repetition_penalty"}
    extension = {k: v for k, v in penalties.items() if k == "repetition_penalty"}
    for extra in ({}, NOT_SPECULATIVE):
        response = completion(server, model, max_tokens=24, extra_body={**extra, **extension}, **openai_fields)
        assert response.choices[0].model_extra["token_ids"] == expected
        chunks = completion(
            server, model, stream=True, max_tokens=24, extra_body={**extra, **extension}, **openai_fields
        )
        assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == expected


def test_a_strong_logit_bias_forces_its_token(server, tiny_engine):
    response = completion(server, tiny_engine.target_id, max_tokens=8, logit_bias={"42": 100})
    assert response.choices[0].model_extra["token_ids"] == [42] * 8


# ---------------------------------------------------------------- bad values

BAD = [  # (what is wrong, body changes, param)
    ("n zero", {"n": 0}, "n"),
    ("n over 8", {"n": 9}, "n"),
    ("n not an integer", {"n": 1.5}, "n"),
    ("frequency_penalty over 2", {"frequency_penalty": 2.5}, "frequency_penalty"),
    ("presence_penalty under -2", {"presence_penalty": -3}, "presence_penalty"),
    ("presence_penalty not a number", {"presence_penalty": "high"}, "presence_penalty"),
    ("repetition_penalty zero", {"repetition_penalty": 0}, "repetition_penalty"),
    ("repetition_penalty denormal", {"repetition_penalty": 5e-324}, "repetition_penalty"),
    ("seed past 64 bits", {"seed": 2**64, "temperature": 1.0}, "seed"),
    ("repetition_penalty over 10", {"repetition_penalty": 11}, "repetition_penalty"),
    ("logit_bias key not a token id", {"logit_bias": {"hello": 1}}, "logit_bias"),
    ("logit_bias negative id", {"logit_bias": {"-1": 1}}, "logit_bias"),
    ("logit_bias over 100", {"logit_bias": {"3": 101}}, "logit_bias.3"),
    ("logit_bias id outside the vocabulary", {"logit_bias": {"5000": 1}}, "logit_bias"),
    ("logit_bias not an object", {"logit_bias": [1, 2]}, "logit_bias"),
    ("too many logit_bias entries", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ("completion logprobs over 5", {"logprobs": 6}, "logprobs"),
    ("completion logprobs negative", {"logprobs": -1}, "logprobs"),
    ("completion logprobs a boolean", {"logprobs": True}, "logprobs"),
    ("response_format of an unknown type", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("json_schema without its object", {"response_format": {"type": "json_schema"}}, "response_format"),
    (
        "json_schema without a schema",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema",
    ),
    ("response_format not an object", {"response_format": "json"}, "response_format"),
    ("response_format on a model without a tokenizer", {"response_format": {"type": "json_object"}}, "response_format"),
    ("tools", {"tools": [{"type": "function"}]}, None),
    ("best_of", {"best_of": 3}, None),
]


@pytest.mark.parametrize("what, changes, param", BAD, ids=[b[0] for b in BAD])
def test_bad_values_are_400s_naming_the_parameter(server, tiny_engine, what, changes, param):
    body = {"model": tiny_engine.target_id, "prompt": PROMPT, "max_tokens": 4, **changes}
    response = httpx.post(server.url + "/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param, error


BAD_CHAT = [
    ("top_logprobs over 20", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("top_logprobs without logprobs", {"top_logprobs": 2}, None),
    ("logprobs not a boolean", {"logprobs": 3}, "logprobs"),
]


@pytest.mark.parametrize("what, changes, param", BAD_CHAT, ids=[b[0] for b in BAD_CHAT])
def test_bad_chat_values_are_400s(json_server, what, changes, param):
    body = {"model": "tiny-json", "messages": MESSAGES, "max_tokens": 4, **changes}
    response = httpx.post(json_server.url + "/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_defaults_and_text_format_are_accepted(json_server):
    response = chat(
        json_server,
        max_tokens=4,
        response_format={"type": "text"},
        logprobs=False,
        top_logprobs=0,
        n=1,
        frequency_penalty=0,
        presence_penalty=0,
        logit_bias={},
    )
    assert len(response.choices) == 1 and response.choices[0].logprobs is None
