"""The drafter contract (`adaptive_spec.drafters.Drafter`): a new draft kind plugs into the loop through
the base class's hooks alone, without `batch.py` or `engine.py` knowing its kind.

Run: .venv/bin/python -m pytest tests/adaptive_spec/test_drafter_contract.py -q
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from tiny import tiny_target

from adaptive_spec import Engine
from adaptive_spec.drafters import Drafter, Proposal

pytestmark = pytest.mark.usefixtures("one_thread")

CORE = Path(__file__).resolve().parents[2] / "adaptive_spec"


class RepeatDrafter(Drafter):
    """A new kind, written here: it proposes the row's most frequent token so far, k times, and keeps
    per row how many tokens each step committed (its `draft_state`), through the hooks."""

    name = "repeat"

    def __init__(self):
        self.prefilled = self.committed = 0

    def on_prefill(self, row, hidden) -> None:
        assert hidden is None  # it did not ask for the target's states
        self.prefilled += 1
        row.draft_state = []

    def on_commit(self, cache, row, before, kept_hidden) -> None:
        assert cache is None and kept_hidden is None
        self.committed += 1
        row.draft_state.append(len(row.ids) - before)

    def propose(self, cache, rows, ks, free=None, depths=None):
        proposals = []
        for row, k in zip(rows, ks, strict=True):
            common = max(set(row.ids), key=row.ids.count)
            proposals.append(Proposal(torch.full((k,), common, dtype=torch.long), None))
        return proposals


def test_a_new_draft_kind_plugs_in_through_the_hooks_and_stays_lossless() -> None:
    model = tiny_target(0)
    drafter = RepeatDrafter()
    engine = Engine(model, drafter)
    plain = Engine(model, None)
    prompts = [[5, 5, 5, 9, 5], [1, 2, 3], [7, 7, 8, 8, 7, 2]]
    expected = [plain.generate(p, max_new_tokens=20, speculative=False).token_ids for p in prompts]
    batch = engine.new_batch(3)
    rows = [batch.add(engine.request(p, max_new_tokens=20, k=2)) for p in prompts]
    outputs = {}
    while len(batch):
        for row, chunk in batch.step():
            if chunk.output is not None:
                outputs[rows.index(row)] = (chunk.output, row.draft_state)
    for i, want in enumerate(expected):
        output, steps = outputs[i]
        assert output.token_ids == want
        assert sum(steps) >= len(want) and all(1 <= n <= 3 for n in steps)  # each step kept 1 to k + 1 tokens
    assert drafter.prefilled == 3 and drafter.committed >= 3 * 7
    assert sum(outputs[i][0].stats.drafted for i in outputs) > 0


def _names(path: Path) -> tuple[set[str], set[str]]:
    """The names a module imports from adaptive_spec.drafters*, and the attribute names it probes
    with hasattr/getattr."""
    tree = ast.parse(path.read_text())
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("adaptive_spec.drafters")
        for alias in node.names
    }
    probed = {
        node.args[1].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("hasattr", "getattr")
        and len(node.args) > 1
        and isinstance(node.args[1], ast.Constant)
    }
    return imported, probed


@pytest.mark.parametrize("module", ["decoding/batch.py", "decoding/row.py", "engine.py"])
def test_the_loop_and_the_engine_name_no_concrete_drafter_and_probe_no_hook(module: str) -> None:
    imported, probed = _names(CORE / module)
    concrete = {name for name in imported if name.endswith("Drafter") and name != "Drafter"}
    assert not concrete, f"{module} imports concrete drafters: {concrete}"
    hooks = {name for name in vars(Drafter) if not name.startswith("_")}
    assert not (probed & hooks), f"{module} probes drafter hooks with hasattr/getattr: {probed & hooks}"
