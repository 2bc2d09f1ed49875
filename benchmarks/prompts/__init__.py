"""The prompt sets the benchmarks ship, by name, and the generator that writes them (make.py).

    items = load_prompts(shipped("chat"))          # adaptive_spec.outputs.prompts.load_prompts
    path = prompt_source("json_schema")            # a file path as given, else a shipped set's name
    items, name = prompt_set(args.prompts, args.domain)   # --prompts FILE, else the shipped domain

Each set is a JSON Lines prompt file (adaptive_spec/outputs/prompts.py reads the format) next to this module:
`chat` (24 hand-written prompts, `adaptive-spec bench`'s default), the four drift domains
`json_extraction`, `sql`, `python` and `casual_chat` (400 prompts each, templates x slot values from
templates/), and `json_schema` (json_extraction's prompts, each with a JSON schema as its
response_format). tests/benchmarks/test_prompt_sets.py checks that make.py reproduces every file; make.py
writes them with one module per set (json_extraction.py, domains.py, tool_calls.py) and draw.py.
"""

from __future__ import annotations

from pathlib import Path

from adaptive_spec.outputs.prompts import PromptFileError, PromptItem, load_prompts

SETS_DIR = Path(__file__).resolve().parent


def shipped(name: str) -> Path:
    """A prompt set shipped with the benchmarks, e.g. `shipped("chat")`."""
    path = SETS_DIR / f"{name}.jsonl"
    if not path.is_file():
        names = sorted(p.stem for p in SETS_DIR.glob("*.jsonl"))
        raise PromptFileError(f"no shipped prompt set {name!r}; shipped: {', '.join(names)}")
    return path


def prompt_source(value: str | Path) -> Path:
    """A prompt file's path, or the name of a shipped set (`json_schema`) when no such file exists."""
    path = Path(value)
    if path.is_file() or path.suffix or len(path.parts) > 1:
        return path  # a missing file gets load_prompts' error
    return shipped(str(value))


def prompt_set(prompts: Path | None, domain: str) -> tuple[list[PromptItem], str]:
    """The items of a `--prompts` file, else of the shipped set `domain`, and the name the figures give
    them: the file's stem, else the domain."""
    return load_prompts(prompts or shipped(domain)), prompts.stem if prompts else domain
