"""A held-out prompt set whose words nobody here wrote: questions about the standard library's own
functions, each carrying the first paragraph of that function's docstring as the interpreter has it.

    .venv/bin/python -m benchmarks.prompts.stdlib /tmp/stdlib.jsonl      # 400 prompts
    adaptive-spec bench-drift --prompts /tmp/stdlib.jsonl --budget-minutes 30

The shipped sets are built from our own templates, so a draft trained on their traffic may learn our
phrasing as much as the domain. This set is for measuring on traffic we did not shape: the modules
are every pure-Python, public, importable module of the running interpreter's standard library
(`sys.stdlib_module_names`, no leading underscore, no test or GUI packages), the functions every
public function or class of theirs with a docstring whose first paragraph is 40 to 400 characters.
One fixed question frame wraps each. The file is written, not shipped: docstrings change between
Python versions (this one: the interpreter's `sys.version` goes in no prompt, so say which Python
wrote a file you measure on). The draw is deterministic for a given interpreter (sorted names,
`draw.Rng`).
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
import warnings
from pathlib import Path

from benchmarks.prompts.draw import Rng

SEED = 20261126
COUNT = 400
DOMAIN = "stdlib"
FRAMES = (
    "Here is the documentation of Python's `{name}`:\n\n{doc}\n\nExplain what it does and show a short example.",
    "What does `{name}` in Python's standard library do? Its docstring says:\n\n{doc}\n\nGive a usage example.",
    "I found `{name}` in the Python docs:\n\n{doc}\n\nWhen would I use it? Show me with a few lines of code.",
)
SKIP_PREFIXES = ("test", "idlelib", "tkinter", "turtle", "lib2to3", "ensurepip", "pydoc_data", "this", "antigravity")


def _first_paragraph(doc: str) -> str:
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())


def documented_names() -> list[tuple[str, str]]:
    """(qualified name, first docstring paragraph), sorted, for the public functions and classes of
    the interpreter's pure-Python public standard-library modules."""
    found: dict[str, str] = {}
    for module_name in sorted(sys.stdlib_module_names):
        if module_name.startswith("_") or module_name.startswith(SKIP_PREFIXES):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(module_name)
        except Exception:  # platform modules (winreg, ...) and ones that need what is not installed
            continue
        if not getattr(module, "__file__", None):  # built into the interpreter: C docstrings
            continue
        for attr in sorted(getattr(module, "__all__", None) or dir(module)):
            if attr.startswith("_"):
                continue
            value = getattr(module, attr, None)
            if not (inspect.isfunction(value) or inspect.isclass(value)):
                continue
            if getattr(value, "__module__", None) != module_name or not value.__doc__:
                continue
            doc = _first_paragraph(value.__doc__)
            if 40 <= len(doc) <= 400:
                found[f"{module_name}.{attr}"] = doc
    return sorted(found.items())


def build(count: int = COUNT, seed: int = SEED) -> list[dict]:
    """`count` prompt lines drawn without replacement from `documented_names()`."""
    names = documented_names()
    if len(names) < count:
        raise ValueError(f"this interpreter's standard library documents {len(names)} names, fewer than {count}")
    rng = Rng(seed)
    pool = list(names)
    lines = []
    for _ in range(count):
        name, doc = pool.pop(rng.below(len(pool)))
        frame = rng.choice(FRAMES)
        lines.append({"messages": [{"role": "user", "content": frame.format(name=name, doc=doc)}], "domain": DOMAIN})
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m benchmarks.prompts.stdlib OUT.jsonl", file=sys.stderr)
        return 2
    lines = build()
    Path(argv[0]).write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
    print(f"{len(lines)} prompts written to {argv[0]} (Python {sys.version.split()[0]})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
