"""The shipped prompt sets in ``adaptive_spec/data`` are well-formed and match their generator."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA_DIR = REPO / "adaptive_spec" / "data"
GENERATOR = REPO / "scripts" / "make_prompts.py"

# file name -> (domain tag, minimum number of prompts)
EXPECTED = {
    "chat.jsonl": ("chat", 20),
    "json_extraction.jsonl": ("json_extraction", 300),
    "sql.jsonl": ("sql", 300),
    "python.jsonl": ("python", 300),
    "casual_chat.jsonl": ("casual_chat", 300),
}
MAX_CHARS = 600


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_prompts", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _user_contents(path: Path) -> list[str]:
    contents = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        where = f"{path.name}:{lineno}"
        obj = json.loads(line)
        assert set(obj) == {"messages", "domain"}, where
        messages = obj["messages"]
        assert isinstance(messages, list) and len(messages) == 1, where
        assert messages[0]["role"] == "user", where
        content = messages[0]["content"]
        assert isinstance(content, str) and content.strip(), where
        contents.append((obj["domain"], content))
    return contents


@pytest.mark.parametrize("name", sorted(EXPECTED))
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
    counts = _load_generator().main(tmp_path)
    assert set(counts) == set(EXPECTED)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(EXPECTED)
    for name, n in counts.items():
        fresh = (tmp_path / name).read_bytes()
        assert fresh.count(b"\n") == n
        assert fresh == (DATA_DIR / name).read_bytes(), (
            f"{name} differs from its generator; run .venv/bin/python scripts/make_prompts.py"
        )
