"""Structured outputs, log-probabilities, n and penalties over HTTP on the built-in default model
(SmolLM2-135M-Instruct), with the official `openai` client.

Run alone with: OMP_NUM_THREADS=2 .venv/bin/python -m pytest tests/service/test_openai_features_real.py -q -m real_model
(fp32 CPU, about 2 minutes once the model is cached as safetensors)

What must hold, on a real tokenizer and a real draft:

- every json_schema output parses and validates against its schema, and is the greedy output of
  the target alone under the same schema (`adaptive_spec: {"speculative": false}`);
- a schema llguidance cannot enforce is a 400 carrying llguidance's message;
- chat and completion log-probabilities are the target alone's, streamed or not, and the tokens'
  bytes spell the text;
- seeded n choices repeat; penalties and logit_bias give the target alone's greedy output;
- plain chat, streamed or not, is the target alone's greedy text, on the path `adaptive-spec serve`
  takes (the app's lifespan loads the models its settings name, as for every test here).
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m-instruct"
NOT_SPECULATIVE = {"adaptive_spec": {"speculative": False}}
NAME = {"type": "string", "maxLength": 24}


def obj(properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


SCHEMAS = [  # (schema, what the user says)
    (obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}), "Maria Lopez is 34 years old."),
    (obj({"city": NAME, "country": NAME}), "I live in Lyon, France."),
    (obj({"sentiment": {"enum": ["positive", "negative", "neutral"]}}), "I loved this restaurant!"),
    (obj({"items": {"type": "array", "items": NAME, "maxItems": 3}}), "Buy milk, eggs and bread."),
    (obj({"is_question": {"type": "boolean"}}), "Is the sky blue?"),
    (obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}), "Give an order code like ABC-123."),
    (obj({"user": obj({"name": NAME, "email": {"type": "string", "maxLength": 40}})}), "Contact Bob at bob@x.org."),
    (
        obj({"answer": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 20}]}}),
        "What is 6 times 7?",
    ),
]


def messages(text: str) -> list[dict]:
    return [{"role": "system", "content": "Reply with JSON only."}, {"role": "user", "content": text}]


@pytest.fixture(scope="module")
def server(live_server):
    with live_server(None, dtype="fp32", device="cpu", draft="early-exit:4") as server:
        yield server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.mark.parametrize("schema, text", SCHEMAS, ids=[f"schema{i}" for i in range(len(SCHEMAS))])
def test_json_schema_outputs_validate_and_equal_the_target_alone(client, schema, text):
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    outputs = [
        client.chat.completions.create(
            model=MODEL,
            messages=messages(text),
            max_tokens=96,
            temperature=0,
            response_format=response_format,
            extra_body=extra,
        ).choices[0]
        for extra in ({}, NOT_SPECULATIVE)
    ]
    assert outputs[0].message.content == outputs[1].message.content
    assert outputs[0].finish_reason == "stop", outputs[0].message.content
    jsonschema.validate(json.loads(outputs[0].message.content), schema)


def test_json_object_parses_streamed_or_not(client):
    kwargs = dict(
        model=MODEL,
        messages=messages("Describe a cat with two fields."),
        max_tokens=96,
        temperature=0,
        response_format={"type": "json_object"},
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs))
    assert streamed == whole.message.content
    if whole.finish_reason == "stop":
        assert isinstance(json.loads(whole.message.content), dict)
    else:  # a model may fill a free-form object up to max_tokens: still a prefix of one
        assert whole.message.content.lstrip().startswith("{")


def test_a_schema_llguidance_cannot_enforce_is_a_400_with_its_message(client):
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "not": {"required": ["a"]}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=messages("hi"),
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )
    assert "Unimplemented keys" in caught.value.body["message"], caught.value.body
    assert caught.value.body["param"] == "response_format"


def test_chat_logprobs_are_the_target_alones_streamed_or_not(server, client):
    engine = server.service.engine
    chat = messages("Name a river.")
    expected = engine.generate(chat, max_new_tokens=24, speculative=False, logprobs=5)
    for extra in ({}, NOT_SPECULATIVE):
        kwargs = dict(
            model=MODEL, messages=chat, max_tokens=24, temperature=0, logprobs=True, top_logprobs=5, extra_body=extra
        )
        whole = client.chat.completions.create(**kwargs).choices[0]
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        for entries in (whole.logprobs.content, streamed):
            assert [e.logprob for e in entries] == pytest.approx(expected.logprobs, abs=1e-4)
            got_top = [a.logprob for e in entries for a in e.top_logprobs]
            assert got_top == pytest.approx([v for top in expected.top_logprobs for _, v in top], abs=1e-4)
            spelled = b"".join(bytes(e.bytes) for e in entries).decode()
            assert spelled == engine.tokenizer.decode(expected.token_ids, skip_special_tokens=False)
        assert whole.message.content == expected.text


def test_completion_logprobs_name_the_tokens_and_their_offsets(server, client):
    engine = server.service.engine
    expected = engine.generate("The capital of France is", max_new_tokens=12, speculative=False, logprobs=3)
    choice = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0, logprobs=3
    ).choices[0]
    assert choice.text == expected.text
    assert choice.logprobs.tokens == [engine.tokenizer.decode([t]) for t in expected.token_ids]
    assert choice.logprobs.token_logprobs == pytest.approx(expected.logprobs, abs=1e-4)
    assert all(3 <= len(top) <= 4 for top in choice.logprobs.top_logprobs)
    assert [
        choice.text[offset:].startswith(token)
        for offset, token in zip(choice.logprobs.text_offset, choice.logprobs.tokens, strict=True)
    ] == [True] * len(choice.logprobs.tokens)


def test_seeded_n_choices_repeat(client):
    kwargs = dict(model=MODEL, messages=messages("Name a colour."), max_tokens=12, temperature=1.0, seed=4, n=3)
    first, again = (client.chat.completions.create(**kwargs) for _ in range(2))
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]


def test_penalties_give_the_target_alones_greedy_output(server, client):
    engine = server.service.engine
    chat = messages("List five fruits.")
    bias_token = engine.tokenizer.encode(" apple")[0]
    penalties = dict(frequency_penalty=0.6, presence_penalty=0.4, logit_bias={str(bias_token): -100})
    expected = engine.generate(
        chat,
        max_new_tokens=32,
        speculative=False,
        repetition_penalty=1.2,
        **{**penalties, "logit_bias": {bias_token: -100.0}},
    )
    for extra in ({}, NOT_SPECULATIVE):
        response = client.chat.completions.create(
            model=MODEL,
            messages=chat,
            max_tokens=32,
            temperature=0,
            extra_body={**extra, "repetition_penalty": 1.2},
            **penalties,
        )
        assert response.choices[0].message.content == expected.text
    assert bias_token not in expected.token_ids


def test_chat_on_the_default_model_equals_the_target_alone(server, client):
    chat = [{"role": "user", "content": "Name three rivers in Europe."}]
    expected = server.service.engine.generate(chat, max_new_tokens=32, speculative=False)
    assert [m.id for m in client.models.list().data] == [MODEL]
    response = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=32, temperature=0)
    assert response.choices[0].message.content == expected.text
    spec = response.usage.model_extra["spec_decode"]
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert spec["adapter_version"] is None and spec["mean_acceptance_length"] >= 1.0
    streamed = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=32, temperature=0, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices) == expected.text
