"""The shipped prompt sets in ``benchmarks/prompts`` are well-formed and match their generator."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from adaptive_spec.outputs.grammar import Grammars
from adaptive_spec.outputs.prompts import PromptFileError, load_prompts
from benchmarks.prompts import SETS_DIR as DATA_DIR
from benchmarks.prompts import make, prompt_source, shipped

# file name -> (domain tag, minimum number of prompts)
EXPECTED = {
    "chat.jsonl": ("chat", 20),
    "json_extraction.jsonl": ("json_extraction", 300),
    "sql.jsonl": ("sql", 300),
    "python.jsonl": ("python", 300),
    "casual_chat.jsonl": ("casual_chat", 300),
    "json_schema.jsonl": ("json_extraction", 300),
    "tool_calls.jsonl": ("tool_calls", 300),
}
AGENT = {"tool_calls.jsonl"}  # multi-turn lines with tools: test_tool_calls_set_is_agent_traffic
WITH_FORMAT = {"json_schema.jsonl"}  # lines that also carry a response_format
MAX_CHARS = 600


def _user_contents(path: Path) -> list[str]:
    contents = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        where = f"{path.name}:{lineno}"
        obj = json.loads(line)
        keys = {"messages", "domain", "response_format"} if path.name in WITH_FORMAT else {"messages", "domain"}
        assert set(obj) == keys, where
        messages = obj["messages"]
        assert isinstance(messages, list) and len(messages) == 1, where
        assert messages[0]["role"] == "user", where
        content = messages[0]["content"]
        assert isinstance(content, str) and content.strip(), where
        contents.append((obj["domain"], content))
    return contents


@pytest.mark.parametrize("name", sorted(set(EXPECTED) - AGENT))
def test_prompt_file_format(name: str) -> None:
    domain, minimum = EXPECTED[name]
    path = DATA_DIR / name
    assert path.is_file(), f"missing {path}"
    rows = _user_contents(path)
    assert len(rows) >= minimum
    assert {d for d, _ in rows} == {domain}
    texts = [c for _, c in rows]
    assert len(set(texts)) == len(texts), f"{name} has duplicate prompts"
    assert max(len(t) for t in texts) <= MAX_CHARS


def test_generator_reproduces_shipped_files(tmp_path: Path) -> None:
    counts = make.main(tmp_path)
    assert set(counts) == set(EXPECTED)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(EXPECTED)
    for name, n in counts.items():
        fresh = (tmp_path / name).read_bytes()
        assert fresh.count(b"\n") == n
        assert fresh == (DATA_DIR / name).read_bytes(), (
            f"{name} differs from its generator; run .venv/bin/python -m benchmarks.prompts.make"
        )


def test_json_schema_prompts_are_json_extractions_own_each_asking_for_its_keys() -> None:
    """Same prompts, same order (bench-drift's held-out split picks the same ones), and every schema
    requires exactly the keys its prompt names, compiles, and accepts an answer with those keys."""
    from tiny_bytes import tiny_byte_tokenizer

    plain, structured = load_prompts(shipped("json_extraction")), load_prompts(prompt_source("json_schema"))
    assert [item.prompt for item in structured] == [item.prompt for item in plain]
    grammars = Grammars(tiny_byte_tokenizer(), 112, eos_ids={2})
    for item in structured:
        schema = item.response_format["json_schema"]["schema"]
        assert item.domain == "json_extraction" and schema["additionalProperties"] is False
        assert schema["required"] and all(key in item.prompt[0]["content"] for key in schema["required"])
        jsonschema.validate(dict.fromkeys(schema["required"], "x"), schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**dict.fromkeys(schema["required"], "x"), "extra": 1}, schema)
    for item in structured[:8]:  # compiling is 1-3 ms each; the same shape throughout
        grammars.compile(item.response_format)


def test_tool_calls_set_is_agent_traffic() -> None:
    """Several tool schemas, multi-turn lines, every past call valid against its tool's schema and
    answered by a tool message; each line forces a call or lets the model answer, and the forced
    grammars compile."""
    from tiny_bytes import tiny_byte_tokenizer

    from adaptive_spec.outputs.tools import ToolUse

    items = load_prompts(prompt_source("tool_calls"))
    assert len(items) >= 300 and {item.domain for item in items} == {"tool_calls"}
    names = {tool["function"]["name"] for item in items for tool in item.tools}
    assert len(names) >= 6
    turns = [len(item.prompt) for item in items]
    assert sum(t == 1 for t in turns) > 100 and sum(t > 1 for t in turns) > 100  # single and multi-turn
    choices = [item.tool_choice if isinstance(item.tool_choice, str) else "named" for item in items]
    assert {"required", "named", "auto"} == set(choices)
    for item in items:
        schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in item.tools}
        for i, message in enumerate(item.prompt):
            for call in message.get("tool_calls") or []:
                jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
                assert item.prompt[i + 1] == {**item.prompt[i + 1], "role": "tool", "tool_call_id": call["id"]}
        assert item.prompt[-1]["role"] == "user"
    grammars = Grammars(tiny_byte_tokenizer(), 112, eos_ids={2})
    for item in items[:16]:
        use = ToolUse.of(item.tools, item.tool_choice, None, item.prompt)
        if use.forced:
            grammars.compile(use.response_format())


@pytest.mark.parametrize(
    ("line", "phrase"),
    [
        ('{"prompt": "hi", "response_format": "json"}', "'response_format' must be an object with a 'type'"),
        ('{"prompt": "hi", "response_format": {"schema": {}}}', "'response_format' must be an object with a 'type'"),
        ('{"prompt": "hi", "domain": 3}', "'domain' must be a string"),
        ('{"messages": []}', "expected a non-empty 'prompt'"),
        ('{"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}', "'tools' go with 'messages'"),
        ('{"messages": [{"role": "user", "content": "hi"}], "tools": {"f": 1}}', "'tools' must be a list"),
        ('{"messages": [{"role": "user", "content": "hi"}], "tool_choice": 3}', "'tool_choice' must be a string"),
        ('{"messages": [{"role": "user"}]}', "expected a non-empty 'prompt'"),
    ],
)
def test_a_malformed_line_is_named_in_the_error(tmp_path: Path, line: str, phrase: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(PromptFileError, match=rf"p\.jsonl:2: .*{phrase}"):
        load_prompts(path)


def test_a_prompt_source_is_a_file_or_a_shipped_name(tmp_path: Path) -> None:
    assert prompt_source("json_schema") == shipped("json_schema")
    (tmp_path / "json_schema").write_text('{"prompt": "mine"}\n')  # a file of that name wins
    assert prompt_source(tmp_path / "json_schema") == tmp_path / "json_schema"
    assert prompt_source("missing.jsonl") == Path("missing.jsonl")  # load_prompts names it
    with pytest.raises(
        PromptFileError, match="shipped: casual_chat, chat, json_extraction, json_schema, python, sql, tool_calls"
    ):
        prompt_source("nosuch")


def test_stdlib_set_is_loadable_distinct_and_deterministic(tmp_path):
    """benchmarks.prompts.stdlib writes a prompt file load_prompts reads: 400 distinct questions, each
    carrying a docstring paragraph of the interpreter's standard library, the same draw twice."""
    from benchmarks.prompts import stdlib

    out = tmp_path / "stdlib.jsonl"
    assert stdlib.main([str(out)]) == 0
    prompts = load_prompts(out)
    contents = [p.prompt[0]["content"] for p in prompts]
    assert len(contents) == len(set(contents)) == stdlib.COUNT
    assert {p.domain for p in prompts} == {"stdlib"}
    assert all(len(c) <= MAX_CHARS for c in contents)
    names = dict(stdlib.documented_names())
    first = contents[0].split("`")[1]
    assert names[first] in contents[0]  # the docstring's own words, not ours
    assert stdlib.build() == [json.loads(line) for line in out.read_text().splitlines()]
    assert stdlib.main([]) == 2
