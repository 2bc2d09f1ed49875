"""Generate the prompt sets shipped in ``benchmarks/prompts/`` from the templates in ``templates/``.


Run from the repository root with::

    .venv/bin/python -m benchmarks.prompts.make            # rewrites benchmarks/prompts/*.jsonl
    .venv/bin/python -m benchmarks.prompts.make OUT_DIR    # writes them elsewhere

which writes these JSON Lines files, one
``{"messages": [{"role": "user", "content": "..."}], "domain": "<tag>"}`` object a line:

* ``chat.jsonl`` -- 24 hand-written general chat prompts (domain ``chat``), used by
  ``adaptive-spec bench``.
* ``json_extraction.jsonl``, ``sql.jsonl``, ``python.jsonl``, ``casual_chat.jsonl`` --
  400 prompts each for the drift benchmark, built from templates x slot values so
  that answers are structurally alike within a domain while their contents differ.
* ``json_schema.jsonl`` -- the prompts of ``json_extraction.jsonl``, in the same order, each with
  a ``response_format`` whose JSON schema requires exactly the keys the prompt asks for (domain
  ``json_extraction``): structured outputs for ``adaptive-spec bench``.
* ``tool_calls.jsonl`` -- 400 agent requests (domain ``tool_calls``): each offers 2-4 of 8 tools
  (weather, flights, calendar, email, currency, products, reminders, orders) in OpenAI's ``tools``
  with a ``tool_choice``; 60% ask for one call (``required``, a quarter of them naming the
  function), 25% carry a finished call and its result and ask for a second call, 15% carry a call
  and its result and let the model answer (``auto``).

The words are data, in ``templates/``: ``pools.json`` (names, cities, products, ...), one file per
domain with its frames, templates and slots, and ``chat.json``. A slot in a domain file is a list
(one of its strings), ``{"pool": NAME}`` (one of a pool's), ``{"randint": [LOW, HIGH]}`` (a number
in that range) or ``{"like": SLOT}`` (drawn as SLOT is, but different from it); the few slots that
compute their value (dates, names, "an 8"-year-old) are `COMPUTED` in draw.py.

The output is deterministic: each domain has its own fixed seed, and the only primitive used is
``random.Random.random()``, whose sequence Python keeps stable across versions (``choice`` and
``randint`` are not). tests/benchmarks/test_prompt_sets.py checks that the shipped files are exactly
what this produces: edit the templates and re-run it, never the data files. Standard library only.

One module per set: json_extraction.py (and json_schema), domains.py (sql, python, casual_chat),
tool_calls.py; draw.py holds what they share (the `Rng`, the pools, the slots).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from benchmarks.prompts.domains import casual_prompt, python_prompt, sql_prompt
from benchmarks.prompts.draw import Rng, build_domain, load_template
from benchmarks.prompts.json_extraction import build_json_schema_rows, json_prompt
from benchmarks.prompts.tool_calls import build_tool_lines

SEED = 20240611
MAX_CHARS = 600
DEFAULT_OUT_DIR = Path(__file__).resolve().parent
CHAT = load_template("chat")


# --------------------------------------------------------------------------- writing

DOMAIN_BUILDERS: dict[str, tuple[str, Callable[[int, Rng], str], int]] = {
    # file stem: (domain tag, builder, per-domain seed offset)
    "json_extraction": ("json_extraction", json_prompt, 1),
    "sql": ("sql", sql_prompt, 2),
    "python": ("python", python_prompt, 3),
    "casual_chat": ("casual_chat", casual_prompt, 4),
}


def _record(content: str, domain: str, response_format: dict | None = None) -> str:
    obj = {"messages": [{"role": "user", "content": content}], "domain": domain}
    if response_format is not None:
        obj["response_format"] = response_format
    return json.dumps(obj, ensure_ascii=False)


def _write(path: Path, prompts: list[str], domain: str, formats: list[dict] | None = None) -> None:
    assert len(set(prompts)) == len(prompts), f"{path.name}: duplicate prompts"
    for p in prompts:
        assert p.strip(), f"{path.name}: empty prompt"
        assert len(p) <= MAX_CHARS, f"{path.name}: prompt over {MAX_CHARS} chars: {p[:80]!r}"
    formats = formats or [None] * len(prompts)
    data = "".join(_record(p, domain, f) + "\n" for p, f in zip(prompts, formats, strict=True))
    path.write_bytes(data.encode("utf-8"))


def main(out_dir: str | Path | None = None) -> dict[str, int]:
    """Write all prompt files into ``out_dir`` (default ``benchmarks/prompts``); return counts."""
    out = Path(out_dir) if out_dir is not None else DEFAULT_OUT_DIR
    out.mkdir(parents=True, exist_ok=True)
    counts: dict[str, int] = {}

    _write(out / "chat.jsonl", CHAT["prompts"], "chat")
    counts["chat.jsonl"] = len(CHAT["prompts"])

    for stem, (domain, builder, offset) in DOMAIN_BUILDERS.items():
        prompts = build_domain(builder, SEED + offset)
        _write(out / f"{stem}.jsonl", prompts, domain)
        counts[f"{stem}.jsonl"] = len(prompts)

    rows = build_json_schema_rows(SEED + DOMAIN_BUILDERS["json_extraction"][2])
    _write(out / "json_schema.jsonl", [text for text, _ in rows], "json_extraction", [f for _, f in rows])
    counts["json_schema.jsonl"] = len(rows)

    lines = build_tool_lines(SEED + 5)
    (out / "tool_calls.jsonl").write_bytes(
        "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines).encode()
    )
    counts["tool_calls.jsonl"] = len(lines)
    return counts


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else None
    for name, n in main(target).items():
        print(f"{name}: {n}")
