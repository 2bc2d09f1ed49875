"""Tool calling on /v1/chat/completions with the official `openai` client, on tiny models: forced
calls (required, a named function) whose arguments validate against their schema, streamed as OpenAI
streams them and equal to the whole answer, greedy output identical with and without speculation,
a two-step conversation round-tripped, both prompt paths (a template that takes tools, and one that
does not), and bad tool input as 400s in OpenAI's error shape.

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/service/test_tool_calls.py -q   (CPU, ~1 min)
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from tiny import tiny_target
from tiny_bytes import tiny_byte_tokenizer
from tiny_tools import SCHEMAS, TOOLS, TOOLS_TEMPLATE

from adaptive_spec import Engine
from adaptive_spec.outputs.tokens import encode_prompt
from adaptive_spec.outputs.tools import Function, tool_parser, tool_prompt
from service.settings import Settings

pytestmark = pytest.mark.usefixtures("one_thread")

ASK = [{"role": "user", "content": "Weather in Oslo?"}]
NOT_SPECULATIVE = {"adaptive_spec": {"speculative": False}}
HERMES = tool_parser("hermes")
FUNCTIONS = [
    Function(t["function"]["name"], t["function"].get("description"), t["function"]["parameters"]) for t in TOOLS
]


def engine(template: str | None) -> Engine:
    tokenizer = tiny_byte_tokenizer() if template is None else tiny_byte_tokenizer(chat_template=template)
    return Engine(tiny_target(0, positions=2048), "early-exit:1", tokenizer, target_id="tiny-tools", k=3)


@pytest.fixture(scope="module", params=["template-takes-tools", "written-in"])
def served(request, live_server):
    """A server whose chat template takes tools, and one whose template ignores them (the fallback)."""
    tools_engine = engine(TOOLS_TEMPLATE if request.param == "template-takes-tools" else None)
    with live_server(tools_engine, max_tokens_limit=400) as server:
        yield server, tools_engine


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(server, messages=ASK, stream=False, **kwargs):
    kwargs = {
        "model": "tiny-tools",
        "messages": messages,
        "max_tokens": 200,
        "temperature": 0,
        "tools": TOOLS,
        **kwargs,
    }
    response = client(server).chat.completions.create(stream=stream, **kwargs)
    return list(response) if stream else response


def assert_valid_calls(message, names):
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize(
    "tool_choice, names",
    [("required", set(SCHEMAS)), ({"type": "function", "function": {"name": "set_lights"}}, {"set_lights"})],
    ids=["required", "named"],
)
def test_a_forced_call_validates_and_equals_the_target_alone_streamed_or_not(served, tool_choice, names):
    server, _ = served
    answers = []
    for extra in ({}, NOT_SPECULATIVE):
        response = chat(server, tool_choice=tool_choice, parallel_tool_calls=False, extra_body=extra)
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert_valid_calls(choice.message, names)
        assert len(choice.message.tool_calls) == 1
        answers.append([(c.function.name, c.function.arguments) for c in choice.message.tool_calls])
        if extra:
            assert response.usage.model_extra["spec_decode"]["num_draft_tokens"] == 0
        else:
            assert response.usage.model_extra["spec_decode"]["num_draft_tokens"] > 0
    chunks = chat(server, stream=True, tool_choice=tool_choice, parallel_tool_calls=False)
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    answers.append([(c.function.name, c.function.arguments) for c in final.message.tool_calls])
    assert answers[0] == answers[1] == answers[2]  # speculative = target alone = streamed
    # streamed as OpenAI does: the head (id, type, name, "" arguments) first, then arguments in pieces
    entries = [e for c in chunks if c.choices for e in c.choices[0].delta.tool_calls or []]
    assert entries[0].id.startswith("call_") and entries[0].type == "function"
    assert entries[0].function.name in names and entries[0].function.arguments == ""
    assert len(entries) > 3 and all(e.id is None and e.function.name is None for e in entries[1:])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_parallel_calls_each_validate(served):
    server, _ = served
    choice = chat(server, tool_choice="required", max_tokens=400).choices[0]
    calls = choice.message.tool_calls
    complete = calls if choice.finish_reason == "tool_calls" else calls[:-1]  # the last may be cut at length
    assert complete and choice.finish_reason in ("tool_calls", "length")
    for call in complete:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_the_openai_client_round_trips_a_two_step_tool_conversation(served):
    """Step 1 forces a call; step 2 sends the assistant's call and the tool's result back, as an
    agent does, and gets an answer that equals the target alone on the same rendered prompt."""
    server, tools_engine = served
    first = chat(server, tool_choice="required", parallel_tool_calls=False).choices[0].message
    call = first.tool_calls[0]
    history = [
        *ASK,
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "snow"})},
    ]
    second = chat(server, messages=history, max_tokens=24)
    assert second.choices[0].finish_reason in ("stop", "length") and second.choices[0].message.tool_calls is None
    # the server rendered the call and the result into the prompt: the same ids as rendering them here
    messages, tools = tool_prompt(history, FUNCTIONS, tools_engine.tokenizer, HERMES)
    ids = encode_prompt(
        messages, tools_engine.tokenizer, tools_engine.vocab_size, tools_engine.max_context, tools=tools
    )
    assert second.usage.prompt_tokens == len(ids)
    rendered = tools_engine.tokenizer.decode(ids)
    assert call.function.arguments.replace(" ", "") in rendered.replace(" ", "") and "snow" in rendered
    alone = tools_engine.generate(ids, 24, speculative=False)
    assert second.choices[0].message.content == alone.text


def test_tool_choice_none_offers_no_tools_and_reads_no_calls(served):
    server, _ = served
    response = chat(server, tool_choice="none", max_tokens=8)
    assert response.choices[0].message.tool_calls is None
    plain = chat(server, max_tokens=8, tools=openai.NOT_GIVEN)
    assert response.usage.prompt_tokens == plain.usage.prompt_tokens  # the tools were left out


BAD_TOOLS = [
    ("tool_choice without tools", {"tools": None, "tool_choice": "required"}, None),
    ("a named function not in tools", {"tool_choice": {"type": "function", "function": {"name": "nope"}}}, None),
    ("two functions of one name", {"tools": [TOOLS[0], TOOLS[0]]}, None),
    ("a bad function name", {"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
    ("a tool that is not a function", {"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    (
        "parameters that are not an object schema",
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
        "tools.0.function.parameters",
    ),
    (
        "a forced schema the grammar cannot enforce",
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"not": {}}}}}}
            ],
            "tool_choice": "required",
        },
        "tools",
    ),
    (
        "a forced call with a response_format",
        {"tool_choice": "required", "response_format": {"type": "json_object"}},
        None,
    ),
    ("tool_choice of an unknown kind", {"tool_choice": "always"}, "tool_choice"),
    ("parallel_tool_calls not a boolean", {"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ("a tool message without its call id", {"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages.1"),
    (
        "a tool message answering no call",
        {"messages": [*ASK, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]},
        None,
    ),
    ("a user message without content", {"messages": [{"role": "user"}]}, "messages.0"),
    (
        "tool_calls on a user message",
        {
            "messages": [
                {
                    "role": "user",
                    "content": "x",
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                }
            ]
        },
        "messages.0",
    ),
]


@pytest.mark.parametrize("what, changes, param", BAD_TOOLS, ids=[b[0] for b in BAD_TOOLS])
def test_bad_tool_input_is_a_400_in_openais_shape(served, what, changes, param):
    server, _ = served
    body = {"model": "tiny-tools", "messages": ASK, "max_tokens": 4, "tools": TOOLS, **changes}
    body = {key: value for key, value in body.items() if value is not None}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param, error


def test_the_json_whitespace_setting_reaches_the_engine_and_bad_settings_are_refused(live_server, tiny_model_dir):
    """ADAPTIVE_SPEC_JSON_WHITESPACE shapes structured outputs and forced calls (grammar.WHITESPACE);
    ADAPTIVE_SPEC_TOOL_CALL_PARSER names a registered format."""
    settings = Settings.from_env(
        {"ADAPTIVE_SPEC_JSON_WHITESPACE": "pretty", "ADAPTIVE_SPEC_TOOL_CALL_PARSER": "hermes"}
    )
    assert (settings.json_whitespace, settings.tool_call_parser) == ("pretty", "hermes")
    assert Settings().json_whitespace == "compact"
    with live_server(
        None, target=str(tiny_model_dir), draft="early-exit:1", dtype="fp32", device="cpu", json_whitespace="pretty"
    ) as server:
        assert server.service.engine.json_whitespace == "pretty"
    with pytest.raises(ValueError, match="json_whitespace must be one of compact, pretty"):
        Settings(json_whitespace="loose")
    with pytest.raises(ValueError, match="tool_call_parser must be one of hermes"):
        Settings(tool_call_parser="mistral")
