"""Chunked prefill (`adaptive_spec.decoding.prefill`): a long prompt joining a busy batch is fed one chunk per
step, the other rows keep decoding meanwhile, and every row's output stays the target's own.

Run: .venv/bin/python -m pytest tests/adaptive_spec/test_prefill.py -q

The tiny models hold 256 positions, so the chunk is made 8 tokens here (`feeding.PREFILL_CHUNK`, read
at every call); the default model's is 512.
"""

from __future__ import annotations

import pytest
import torch
from tiny import llama, tiny_target

from adaptive_spec import Engine
from adaptive_spec.cache import feeding

pytestmark = pytest.mark.usefixtures("one_thread")

SHORT = [[5, 17, 33, 8], [44, 2], [3, 9, 27]]
LONG = [(7 * i + 3) % 100 for i in range(43)]  # 42 tokens of context: chunks 8 x 5 + 2


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(feeding, "PREFILL_CHUNK", 8)


def _decode(engine: Engine, long_at_step: int, budget: int = 12) -> tuple[dict, list[int], object]:
    """Three short rows decode; the long prompt arrives at `long_at_step`. Returns outputs by prompt,
    the number of rows that advanced at each step while it was staged, and the long row."""
    batch = engine.new_batch(4)
    rows = {batch.add(engine.request(p, max_new_tokens=budget)): i for i, p in enumerate(SHORT)}
    outputs, advancing, step, long_row = {}, [], 0, None
    while len(batch):
        if step == long_at_step:
            long_row = batch.add(engine.request(LONG, max_new_tokens=budget))
            rows[long_row] = len(SHORT)
        results = batch.step()
        if long_row is not None and long_row in batch.prefills:
            advancing.append(len(results))
        for row, chunk in results:
            if chunk.output is not None:
                outputs[rows[row]] = chunk.output.token_ids
        step += 1
    return outputs, advancing, long_row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("draft", [None, "head", "early-exit:2"])
def test_a_long_prompt_joins_chunk_by_chunk_and_every_row_equals_the_target_alone(dtype, draft) -> None:
    model = (tiny_target(0) if dtype == torch.float32 else llama(0, init=0.02)).to(dtype)
    alone = Engine(model, None)
    expected = [alone.generate(p, max_new_tokens=12, speculative=False).token_ids for p in [*SHORT, LONG]]
    engine = Engine(model, draft)
    outputs, advancing, long_row = _decode(engine, long_at_step=2)
    assert [outputs[i] for i in range(len(expected))] == expected
    # 6 chunks: the long row joined at the 6th step; each staged step still advanced the 3 short rows
    assert advancing == [3] * 5, advancing
    assert long_row.stats.prefill_s > 0


def test_a_staged_prompts_cache_is_bitwise_an_unstaged_prefill() -> None:
    model = llama(0, init=0.02).to(torch.bfloat16)
    engine = Engine(model, None)
    staged_batch = engine.new_batch(2)
    staged_batch.add(engine.request(SHORT[0], max_new_tokens=4))
    staged = staged_batch.add(engine.request(LONG, max_new_tokens=4))
    while staged in staged_batch.prefills:
        staged_batch.step()
    direct_batch = engine.new_batch(1)
    direct = direct_batch.add(engine.request(LONG, max_new_tokens=4))
    n = len(LONG) - 1
    assert direct_batch.target_cache.lengths[direct.slot] == n
    assert staged_batch.target_cache.lengths[staged.slot] == n + 1  # it joined, then decoded in the same step
    for layer in range(model.config.num_hidden_layers):
        for mine, theirs in (
            (staged_batch.target_cache.keys, direct_batch.target_cache.keys),
            (staged_batch.target_cache.values, direct_batch.target_cache.values),
        ):
            assert torch.equal(mine[layer][staged.slot, :, :n], theirs[layer][direct.slot, :, :n])


def test_a_staged_row_counts_against_the_batch_and_can_be_cancelled() -> None:
    engine = Engine(tiny_target(0), "head")
    batch = engine.new_batch(2)
    batch.add(engine.request(SHORT[0], max_new_tokens=30))
    staged = batch.add(engine.request(LONG, max_new_tokens=5))
    assert staged in batch.prefills and len(batch) == 2 and batch.full
    with pytest.raises(RuntimeError, match="full"):
        batch.add(engine.request(SHORT[1], max_new_tokens=5))
    batch.step()
    batch.remove(staged)  # a client gone mid-prefill
    assert staged not in batch.prefills and len(batch) == 1 and len(batch.rows) == 1
    late = batch.add(engine.request(LONG, max_new_tokens=5))  # the staging cache starts clean
    outputs = {}
    while len(batch):
        for row, chunk in batch.step():
            if chunk.output is not None:
                outputs[id(row)] = chunk.output.token_ids
    expected = Engine(engine.target, None).generate(LONG, max_new_tokens=5, speculative=False).token_ids
    assert outputs[id(late)] == expected


def test_a_short_prompt_or_an_idle_batch_prefills_at_once() -> None:
    engine = Engine(tiny_target(0), None)
    batch = engine.new_batch(3)
    first = batch.add(engine.request(LONG, max_new_tokens=4))  # nobody decodes yet: at once
    short = batch.add(engine.request(SHORT[1], max_new_tokens=4))  # one chunk or less: at once
    assert first.slot == 0 and short.slot == 1 and not len(batch.prefills)
