"""Tool calling in the core (adaptive_spec/outputs/tools): reading Hermes-style calls whole and streamed,
the tools into the prompt (through a template that takes them, or written in), and forced calls
whose arguments always match their schema, lossless under speculation, on tiny models.

Run: .venv/bin/python -m pytest tests/adaptive_spec/test_tools.py -q   (CPU, about 30 s)
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from tiny import tiny_target
from tiny_bytes import tiny_byte_tokenizer
from tiny_tools import SCHEMAS, TOOLS, TOOLS_TEMPLATE

from adaptive_spec import Engine
from adaptive_spec.outputs.grammar import WHITESPACE, Grammars
from adaptive_spec.outputs.tokens import encode_prompt
from adaptive_spec.outputs.tools import (
    TOOL_PARSERS,
    Function,
    ToolCallParser,
    ToolError,
    register_tool_parser,
    template_takes_tools,
    tool_parser,
    tool_prompt,
)
from adaptive_spec.outputs.tools.hermes import HermesParser

pytestmark = pytest.mark.usefixtures("one_thread")

HERMES = tool_parser("hermes")
FUNCTIONS = [
    Function(t["function"]["name"], t["function"].get("description"), t["function"]["parameters"]) for t in TOOLS
]

TWO_CALLS = (
    "Checking both.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "note": "a \\"}\\" inside", "d": [1, {"x": 2}]}}\n</tool_call>\n'
    '<tool_call>\n{"arguments": {"on": true}, "name": "set_lights"}\n</tool_call>'
)


def streamed(text: str, step: int, parallel: bool = True):
    """(content, {index: [id, name, arguments]}, entries) as a client accumulates a stream read `step`
    characters at a time, and the stream's own final calls."""
    stream = HERMES.stream(parallel)
    content, calls, entries = "", {}, []
    deltas = [stream.push(text[i : i + step]) for i in range(0, len(text), step)] + [stream.finish("")]
    for delta in deltas:
        content += delta.content
        for entry in delta.tool_calls:
            entries.append(entry)
            call = calls.setdefault(entry["index"], [entry.get("id"), "", ""])
            call[1] += entry["function"].get("name", "")
            call[2] += entry["function"]["arguments"]
    return content, calls, entries, stream


# ---------------------------------------------------------------- reading calls


def test_hermes_reads_the_content_and_each_call_with_the_arguments_text_the_model_wrote():
    content, calls = HERMES.parse(TWO_CALLS)
    assert content == "Checking both."
    assert [c.name for c in calls] == ["get_weather", "set_lights"]
    # the model's own text (spaces and key order kept), not a re-serialisation
    assert calls[0].arguments == '{"city": "Oslo", "note": "a \\"}\\" inside", "d": [1, {"x": 2}]}'
    assert json.loads(calls[1].arguments) == {"on": True}
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize(
    "text",
    [
        TWO_CALLS,
        "Plain text with <tool but no call, and trailing space  ",
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
        "  \n<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Li',  # cut by max_tokens
    ],
)
@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_a_stream_ends_with_what_a_whole_parse_gives(text, step):
    whole_content, whole_calls = HERMES.parse(text)
    content, calls, _, stream = streamed(text, step)
    assert stream.content == whole_content
    assert [(c.name, c.arguments) for c in stream.calls] == [(c.name, c.arguments) for c in whole_calls]
    assert content == (whole_content or "")  # what was sent adds up to the final content
    assert [(name, args) for _, name, args in calls.values()] == [(c.name, c.arguments) for c in whole_calls]
    assert [call[0] for call in calls.values()] == [c.id for c in stream.calls]


def test_no_call_that_parses_leaves_the_whole_output_as_content():
    assert HERMES.parse("no call <tool_call") == ("no call <tool_call", [])
    text = "x <tool_call>\n{broken\n</tool_call>"
    assert HERMES.parse(text) == (text, [])


def test_an_output_cut_inside_a_call_keeps_it_as_far_as_it_got():
    content, calls = HERMES.parse('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Li')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Li')]


def test_parallel_false_keeps_the_first_call_only():
    content, calls = HERMES.parse(TWO_CALLS, parallel=False)
    assert content == "Checking both." and [c.name for c in calls] == ["get_weather"]


def test_a_stream_sends_the_head_first_then_the_arguments_in_pieces_as_openai_does():
    _, _, entries, _ = streamed(TWO_CALLS, 1)
    first = [e for e in entries if e["index"] == 0]
    assert first[0]["type"] == "function" and first[0]["id"].startswith("call_")
    assert first[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert all(set(e) == {"index", "function"} and set(e["function"]) == {"arguments"} for e in first[1:])
    assert len(first) > 10  # the arguments came piece by piece, not at the end
    # set_lights writes its arguments before its name: it goes out whole once its block closes
    second = [e for e in entries if e["index"] == 1]
    assert len(second) == 1 and second[0]["function"]["name"] == "set_lights"


def test_content_is_held_back_only_where_a_call_may_start():
    stream = HERMES.stream()
    assert stream.push("Sure").content == "Sure"
    assert stream.push(" <tool").content == ""  # may start <tool_call>; the space may precede it
    assert stream.push("box").content == " <toolbox"
    assert stream.finish("").content == "" and stream.content == "Sure <toolbox"


# ---------------------------------------------------------------- the registry


def test_formats_register_by_name_and_an_unknown_one_is_refused():
    @register_tool_parser("test-upper")
    class Upper(HermesParser):
        pass

    try:
        assert isinstance(tool_parser("test-upper"), Upper) and "hermes" in TOOL_PARSERS
    finally:
        TOOL_PARSERS.pop("test-upper")
    with pytest.raises(ToolError, match=r"unknown tool-call parser 'nope'.*hermes"):
        tool_parser("nope")
    assert issubclass(HermesParser, ToolCallParser)


# ---------------------------------------------------------------- the prompt

HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'},
]


def test_a_template_that_takes_tools_gets_them_and_the_calls_arguments_as_objects():
    tokenizer = tiny_byte_tokenizer(chat_template=TOOLS_TEMPLATE)
    assert template_takes_tools(tokenizer)
    messages, tools = tool_prompt(HISTORY, FUNCTIONS, tokenizer, HERMES)
    assert tools == TOOLS
    assert messages[2]["content"] == "" and messages[2]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Oslo",
        "days": 2,
    }
    text = tokenizer.decode(encode_prompt(messages, tokenizer, 112, None, tools=tools))
    assert '"name": "get_weather"' in text and '"description": "The forecast"' in text
    assert '"arguments": {"city": "Oslo", "days": 2}}' in text  # an object, not a JSON string in a string
    assert '<|im_start|>tool\n{"temp": 3}' in text


def test_a_template_without_tools_gets_them_written_in_by_the_format():
    tokenizer = tiny_byte_tokenizer()  # ChatML that ignores `tools`, like SmolLM2's
    assert not template_takes_tools(tokenizer)
    messages, tools = tool_prompt(HISTORY, FUNCTIONS, tokenizer, HERMES)
    assert tools is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(TOOLS[1]) in messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    assert (
        messages[2]["content"]
        == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
    )
    assert messages[3]["content"] == '<tool_response>\n{"temp": 3}\n</tool_response>'
    # no tools offered now (tool_choice none): the history is still written in, with no tool list
    plain, _ = tool_prompt(HISTORY[1:], [], tokenizer, HERMES)
    assert plain[0]["role"] == "user" and "# Tools" not in json.dumps(plain)


# ---------------------------------------------------------------- forced calls


@pytest.fixture(scope="module")
def engine():
    return Engine(
        tiny_target(0, positions=1024), "early-exit:1", tiny_byte_tokenizer(chat_template=TOOLS_TEMPLATE), k=3
    )


def forced(functions, parallel):
    return {
        "type": "grammar",
        "syntax": "lark",
        "definition": HERMES.forced_grammar(functions, parallel, WHITESPACE["compact"]),
    }


@pytest.mark.parametrize(
    "names, parallel",
    [(["get_weather", "set_lights"], False), (["set_lights"], False), (["get_weather", "set_lights"], True)],
    ids=["required", "named", "required-parallel"],
)
def test_a_forced_call_parses_matches_its_schema_and_equals_the_target_alone(engine, names, parallel):
    functions = [f for f in FUNCTIONS if f.name in names]
    messages, tools = tool_prompt([{"role": "user", "content": "Go."}], FUNCTIONS, engine.tokenizer, HERMES)
    prompt = encode_prompt(messages, engine.tokenizer, engine.vocab_size, engine.max_context, tools=tools)
    grammar = forced(functions, parallel)
    alone = engine.generate(prompt, 160, response_format=grammar, speculative=False)
    spec = engine.generate(prompt, 160, response_format=grammar)
    assert spec.token_ids == alone.token_ids and spec.stats.drafted > 0
    content, calls = HERMES.parse(alone.text, parallel)
    complete = calls if alone.finish_reason == "stop" else calls[:-1]
    assert content is None and complete, alone.text
    for call in complete:
        assert call.name in names
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    if not parallel:
        assert alone.finish_reason == "stop" and len(calls) == 1
        assert alone.text.startswith("<tool_call>\n") and alone.text.endswith("}\n</tool_call>")


def test_parameters_with_defs_are_enforced_through_their_references(engine):
    parameters = {
        "type": "object",
        "$defs": {"room": {"enum": ["hall", "den"]}},
        "properties": {"room": {"$ref": "#/$defs/room"}},
        "required": ["room"],
        "additionalProperties": False,
    }
    out = engine.generate([5, 6, 7], 80, response_format=forced([Function("pick", None, parameters)], False))
    _, calls = HERMES.parse(out.text)
    assert json.loads(calls[0].arguments)["room"] in ("hall", "den")


def test_a_schema_the_grammar_cannot_enforce_is_an_input_error(engine):
    from adaptive_spec import InputError

    bad = Function("f", None, {"type": "object", "properties": {"a": {"not": {"type": "string"}}}})
    with pytest.raises(InputError, match="response_format"):
        engine.request([5, 6], 8, response_format=forced([bad], False))


# ---------------------------------------------------------------- forced bytes, proposed for free


def forced_positions(engine, grammar, tokens: list[int]) -> int:
    """Output positions whose token the grammar forced (Matcher.forced), replayed along `tokens`."""
    matcher = Grammars(engine.tokenizer, engine.vocab_size, engine.eos_ids).compile(grammar).new_matcher()
    count = 0
    for token in tokens:
        count += bool(matcher.forced(1, guess_space=False))
        assert matcher.accept(token)
    return count


def test_where_the_compact_policy_leaves_a_space_optional_the_forced_bytes_go_on_through_it(engine):
    """Matcher.forced guesses the space models write (`": "`, `", "`) and the bytes forced after it; a
    guess to verify, tokenized as usual, and the matcher is left as it was."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    }
    grammars = Grammars(engine.tokenizer, engine.vocab_size, engine.eos_ids)
    matcher = grammars.compile({"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}).new_matcher()
    text = lambda tokens: engine.tokenizer.decode(tokens)  # noqa: E731
    for token in engine.tokenizer.encode('{"city":', add_special_tokens=False):
        assert matcher.accept(token)
    before = (matcher.consumed, matcher.mask())
    assert matcher.forced(8, guess_space=False) == []  # a space may come or not: nothing is forced
    assert text(matcher.forced(8)) == ' "'  # the space guessed, then the string's opening quote
    assert (matcher.consumed, matcher.mask().tolist()) == (before[0], before[1].tolist())
    for token in engine.tokenizer.encode(' "Porto",', add_special_tokens=False):
        assert matcher.accept(token)
    assert text(matcher.forced(8)) == ' "unit"'  # the key that must come next, after a space (one may follow it too)
    assert text(matcher.forced(3)) == ' "u'  # within the limit
    assert matcher.accept(engine.tokenizer.encode(" ", add_special_tokens=False)[0])
    assert text(matcher.forced(8)) == '"unit"'  # the space written: the key alone, as before


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_the_bytes_a_grammar_forces_are_proposed_with_no_draft_and_kept(engine, temperature):
    """At dynamic k a forced call's fixed bytes (`tool_call>`, `"name": "`, `", "arguments": {"`, each
    key) are appended to every row's chain for the target to verify (row.py `Row.forced_tail`), even
    where the policy leaves this random draft out: nearly all of them come out accepted, and greedy
    output is still the target's alone."""
    dynamic = Engine(engine.target, "early-exit:1", engine.tokenizer)  # k=None: dynamic
    messages, tools = tool_prompt([{"role": "user", "content": "Go."}], FUNCTIONS, engine.tokenizer, HERMES)
    prompt = encode_prompt(messages, engine.tokenizer, engine.vocab_size, engine.max_context, tools=tools)
    grammar = forced(FUNCTIONS, False)
    out = dynamic.generate(prompt, 160, response_format=grammar, temperature=temperature, seed=3)
    if temperature == 0.0:
        assert out.token_ids == dynamic.generate(prompt, 160, response_format=grammar, speculative=False).token_ids
    _, calls = HERMES.parse(out.text)
    assert out.finish_reason == "stop" and len(calls) == 1, out.text
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])
    forced_here = forced_positions(dynamic, grammar, out.token_ids)
    assert forced_here >= 30, out.text  # `<tool_call>\n{"name": "` alone is 22 bytes
    # Missed: a bonus token after each run longer than MAX_FORCED (and the first token of a stream).
    assert out.stats.accepted >= 0.9 * forced_here, (out.stats.accepted, forced_here)
    assert out.stats.target_forwards < len(out.token_ids) - 0.9 * forced_here


def test_a_sampled_chain_takes_its_forced_tail_as_one_hot_draft_distributions():
    from adaptive_spec.decoding.row import _extended
    from adaptive_spec.drafters import Proposal

    probs = torch.softmax(torch.randn(2, 11), dim=-1)
    chain = Proposal(torch.tensor([4, 7]), probs, forwards=2)
    longer = _extended(chain, [9, 1])
    assert longer.tokens.tolist() == [4, 7, 9, 1] and longer.forced == 2 and longer.forwards == 2
    assert torch.equal(longer.probs[:2], probs)
    assert longer.probs[2].tolist() == [float(i == 9) for i in range(11)]
    assert longer.probs[3].tolist() == [float(i == 1) for i in range(11)]
    greedy = _extended(Proposal(torch.tensor([], dtype=torch.long), None), [5])
    assert greedy.tokens.tolist() == [5] and greedy.probs is None  # deterministic, as a copied proposal
