"""Several adapters served at once (`adaptive_spec.drafters.slots`): each request drafts with its
domain's adapter, rows of different domains share a batch and stay lossless, and a bound evicts
the adapter used least recently.

Run: .venv/bin/python -m pytest tests/adaptive_spec/test_adapter_slots.py -q   (CPU, a few seconds)
"""

from __future__ import annotations

import pytest
from adapter_files import make_adapter
from tiny import tiny_target

from adaptive_spec import Engine
from adaptive_spec.drafters.slots import AdapterSlot, AdapterSlots

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 17, 33, 8, 5, 17, 33, 8, 5, 17], [44], list(range(20, 43)), [7, 7, 2], [90, 12, 64, 90], [3, 9, 27]]
DOMAINS = ["sql", "python", None, "sql", "chat", "python"]


def test_slots_map_domains_to_their_adapter_or_the_general_one_and_evict_the_least_used() -> None:
    slots = AdapterSlots(max_domains=2)
    assert slots.for_domain("sql") is None  # nothing held: the base draft
    general = AdapterSlot("1", None, object(), object(), None)
    slots.put(general)
    assert slots.for_domain("sql") is general and slots.for_domain(None) is general
    sql, python, chat = (
        AdapterSlot(str(v), d, object(), object(), None) for v, d in [(2, "sql"), (3, "python"), (4, "chat")]
    )
    assert slots.put(sql) == [] and slots.put(python) == []
    assert slots.for_domain("sql") is sql  # sql is now the most recently used
    assert slots.put(chat) == [python]  # the bound of 2 domain adapters evicts the least used
    assert slots.versions() == {"sql": "2", "chat": "4", None: "1"}
    assert slots.for_domain("python") is general
    assert slots.remove(None) is general and slots.for_domain("python") is None


def test_each_domain_drafts_with_its_own_adapter_in_a_mixed_batch(tmp_path) -> None:
    target = tiny_target(1)
    for name, seed in [("general", 2), ("sql", 3), ("python", 4)]:
        make_adapter(target, 2, tmp_path / name, seed=seed)
    engine = Engine(target, "early-exit:2")
    plain = [engine.generate(p, max_new_tokens=24, speculative=False).token_ids for p in PROMPTS]
    engine.load_adapter(tmp_path / "general", "1")
    engine.load_adapter(tmp_path / "sql", "2", domain="sql")
    engine.load_adapter(tmp_path / "python", "3", domain="python")
    batch = engine.new_batch(6)
    rows = [
        batch.add(engine.request(p, max_new_tokens=24, k=3, domain=d)) for p, d in zip(PROMPTS, DOMAINS, strict=True)
    ]
    assert [row.adapter.version for row in rows] == ["2", "3", "1", "2", "1", "3"]
    outputs = {}
    while len(batch):
        for row, chunk in batch.step():
            if chunk.output is not None:
                outputs[rows.index(row)] = chunk.output
    for i, expected in enumerate(plain):
        assert outputs[i].token_ids == expected, (i, DOMAINS[i])
        assert outputs[i].stats.adapter_version == ["2", "3", "1", "2", "1", "3"][i]
    assert sum(out.stats.drafted for out in outputs.values()) > 0


def test_a_domain_swap_mid_batch_touches_only_that_domains_rows(tmp_path) -> None:
    target = tiny_target(1)
    make_adapter(target, 2, tmp_path / "sql-a", seed=3)
    make_adapter(target, 2, tmp_path / "sql-b", seed=5)
    engine = Engine(target, "early-exit:2")
    plain = [engine.generate(p, max_new_tokens=30, speculative=False).token_ids for p in PROMPTS[:4]]
    engine.load_adapter(tmp_path / "sql-a", "1", domain="sql")
    batch = engine.new_batch(4)
    rows = [
        batch.add(engine.request(p, max_new_tokens=30, k=2, domain=d))
        for p, d in zip(PROMPTS[:4], DOMAINS[:4], strict=True)
    ]
    for _ in range(3):
        batch.step()
    other = {row: batch.draft_cache.lengths[row.slot] for row in batch.rows if row.request.domain != "sql"}
    engine.load_adapter(tmp_path / "sql-b", "2", domain="sql")
    for row in batch.rows:
        if row.request.domain == "sql":
            assert row.adapter.version == "2" and batch.draft_cache.lengths[row.slot] == 0
        else:
            assert row.adapter is None and batch.draft_cache.lengths[row.slot] == other[row]
    outputs = {}
    while len(batch):
        for row, chunk in batch.step():
            if chunk.output is not None:
                outputs[rows.index(row)] = chunk.output.token_ids
    assert [outputs[i] for i in range(4)] == plain
    engine.unload_adapter(domain="sql")
    assert engine.adapters.versions() == {}


def test_the_adapter_bound_evicts_and_rows_fall_back(tmp_path) -> None:
    target = tiny_target(1)
    for name, seed in [("a", 2), ("b", 3)]:
        make_adapter(target, 2, tmp_path / name, seed=seed)
    engine = Engine(target, "early-exit:2", max_adapters=1)
    engine.load_adapter(tmp_path / "a", "1", domain="sql")
    engine.load_adapter(tmp_path / "b", "2", domain="python")  # evicts sql
    assert engine.adapters.versions() == {"python": "2"}
    out = engine.generate(PROMPTS[0], max_new_tokens=10, k=2, domain="sql")
    assert out.stats.adapter_version is None  # no sql adapter, no general one: the base draft
    assert out.token_ids == engine.generate(PROMPTS[0], max_new_tokens=10, speculative=False).token_ids
