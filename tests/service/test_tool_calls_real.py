"""Tool calling over HTTP on the built-in default model (SmolLM2-135M-Instruct, fp32), with the
official `openai` client. Its ChatML template ignores `tools`, so the tools are written into the
system prompt in Hermes' format (adaptive_spec/outputs/tools/prompt.py).

Run alone with: .venv/bin/python -m pytest tests/service/test_tool_calls_real.py -q -m real_model
(CPU, about a minute once the model is cached as safetensors)

What must hold: `tool_choice: required` returns a call whose arguments validate against the
function's schema, with speculation on (the head draft at k = 3), token for token the target
alone's greedy output; the call and its result go back in a second turn, which answers.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m-instruct"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 32}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
FLIGHTS = {
    "type": "object",
    "properties": {"origin": {"type": "string", "maxLength": 32}, "destination": {"type": "string", "maxLength": 32}},
    "required": ["origin", "destination"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "search_flights", "description": "Find flights", "parameters": FLIGHTS}},
]
SCHEMAS = {"get_weather": WEATHER, "search_flights": FLIGHTS}
ASK = [{"role": "user", "content": "What's the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def client(live_server):
    with live_server(
        None, dtype="fp32", device="cpu", draft="head", k=3, max_tokens_limit=256, request_timeout_s=600.0
    ) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_required_returns_a_valid_call_identical_to_the_target_alone_and_the_result_goes_back(client):
    kwargs = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 96}
    kwargs |= {"temperature": 0, "parallel_tool_calls": False}
    speculative = client.chat.completions.create(**kwargs)
    alone = client.chat.completions.create(**kwargs, extra_body={"adaptive_spec": {"speculative": False}})
    choice = speculative.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert speculative.usage.model_extra["spec_decode"]["num_draft_tokens"] > 0  # speculation was on
    assert [(c.function.name, c.function.arguments) for c in alone.choices[0].message.tool_calls] == [
        (call.function.name, call.function.arguments)
    ]
    assert speculative.usage.completion_tokens == alone.usage.completion_tokens

    history = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})},
    ]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=32, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > speculative.usage.prompt_tokens  # the call and its result were read
