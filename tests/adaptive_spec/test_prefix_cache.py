"""Prefix caching (`adaptive_spec.cache.prefix`): a prompt that starts as an earlier one reuses its
keys and values, and every output stays the target's own, bitwise.

Run: .venv/bin/python -m pytest tests/adaptive_spec/test_prefix_cache.py -q

What must hold:

- a lookup returns the longest cached prefix in whole blocks, always leaving a token to compute;
  eviction keeps within the byte budget and drops a chain's leaves before its root; a frozen cache
  takes nothing in;
- a row prefilled from a cached prefix holds, bitwise, the keys and values of a whole prefill;
- in bf16 (near-ties everywhere), greedy output with the cache equals the target alone without it,
  for every draft kind, alone and in a batch with staggered rows and a staged (chunked) prefill;
- the engine turns the cache on only where `exact.check` measured a split prefill to give the
  same bits, and says so in its report.
"""

from __future__ import annotations

import pytest
import torch
from tiny import llama

from adaptive_spec import Engine
from adaptive_spec.cache import feeding, kv
from adaptive_spec.cache.prefix import BLOCK, PrefixCache
from adaptive_spec.kernels import exact

pytestmark = pytest.mark.usefixtures("one_thread")

BF16 = torch.bfloat16
SYSTEM = [(11 * i + 5) % 97 + 2 for i in range(40)]  # a shared "system prompt and tools": 2 blocks and a half
QUESTIONS = [[61, 7, 3], [9, 44, 18, 90, 12], [33], [70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82]]
PROMPTS = [SYSTEM + q for q in QUESTIONS] + [[*SYSTEM[:20], 4, 4, 4]]  # the last shares one block only


def bf16_target(seed: int = 0):
    return llama(seed, init=0.02).to(BF16)


def _prefilled(model, ids: list[int]) -> kv.BatchCache:
    cache = kv.BatchCache.for_model(model)
    feeding.feed(model, cache, [cache.add_row()], [ids])
    return cache


# =================================================================================================
# The cache itself
# =================================================================================================


def test_a_lookup_finds_the_longest_cached_prefix_in_whole_blocks_and_leaves_a_token() -> None:
    model = bf16_target()
    exact.install(model)
    cache = PrefixCache(max_bytes=1 << 30)
    assert cache.lookup(PROMPTS[0]) is None
    first = PROMPTS[0]  # 43 tokens: blocks 0-15 and 16-31 are whole
    cache.insert(first, _prefilled(model, first), 0, None)
    assert len(cache) == 2
    assert cache.lookup(PROMPTS[1]).length == 2 * BLOCK  # 40 shared tokens: 2 whole blocks
    assert cache.lookup(PROMPTS[4]).length == BLOCK  # 20 shared: 1 block
    assert cache.lookup([1, 2, 3, *SYSTEM]) is None  # the same tokens elsewhere are not a prefix
    assert cache.lookup(first[: 2 * BLOCK]).length == BLOCK  # a prompt of exactly 2 blocks keeps its last to compute
    hit = cache.lookup(first[: 2 * BLOCK + 1])
    assert hit.length == 2 * BLOCK and hit.states is None
    assert len(hit.keys) == model.config.num_hidden_layers and hit.keys[0].shape[1] == 2 * BLOCK
    assert cache.stats()["hits"] == 4 and cache.stats()["tokens_reused"] == 6 * BLOCK


def test_eviction_keeps_to_the_budget_and_drops_leaves_before_their_root() -> None:
    model = bf16_target()
    exact.install(model)
    one = PrefixCache(max_bytes=1 << 30)
    one.insert(PROMPTS[0], _prefilled(model, PROMPTS[0]), 0, None)
    block_bytes = one.nbytes // 2
    cache = PrefixCache(max_bytes=3 * block_bytes)  # room for three blocks
    cache.insert(PROMPTS[0], _prefilled(model, PROMPTS[0]), 0, None)  # root A, leaf B
    other = [3] * 40
    cache.insert(other, _prefilled(model, other), 0, None)  # root C, leaf D: B, the oldest leaf, goes
    assert cache.nbytes <= cache.max_bytes and len(cache) == 3
    assert cache.lookup(PROMPTS[1]).length == BLOCK  # A stayed, B went
    assert cache.lookup([*other, 1]).length == 2 * BLOCK


def test_a_frozen_cache_takes_nothing_in_and_a_cache_of_states_wants_them() -> None:
    model = bf16_target()
    exact.install(model)
    cache = PrefixCache(max_bytes=1 << 30)
    with cache.frozen():
        cache.insert(PROMPTS[0], _prefilled(model, PROMPTS[0]), 0, None)
    assert len(cache) == 0
    with_states = PrefixCache(max_bytes=1 << 30, keep_states=True)
    with_states.insert(PROMPTS[0], _prefilled(model, PROMPTS[0]), 0, None)  # no states given: nothing kept
    assert len(with_states) == 0
    states = torch.randn(len(PROMPTS[0]), model.config.hidden_size).to(BF16)
    with_states.insert(PROMPTS[0], _prefilled(model, PROMPTS[0]), 0, states)
    assert torch.equal(with_states.lookup(PROMPTS[1]).states, states[: 2 * BLOCK])


def test_a_row_prefilled_after_a_cached_prefix_holds_the_bits_of_a_whole_prefill() -> None:
    model = bf16_target()
    exact.install(model)
    prompt = PROMPTS[3]
    whole = _prefilled(model, prompt)
    prefixes = PrefixCache(max_bytes=1 << 30)
    prefixes.insert(PROMPTS[0], _prefilled(model, PROMPTS[0]), 0, None)
    hit = prefixes.lookup(prompt)
    assert hit is not None and hit.length == 2 * BLOCK
    cache = kv.BatchCache.for_model(model)
    row = cache.add_row()
    cache.write_row(row, hit.keys, hit.values)
    feeding.feed(model, cache, [row], [prompt[hit.length :]])
    n = len(prompt)
    assert cache.lengths[row] == n
    for mine, theirs in ((cache.keys, whole.keys), (cache.values, whole.values)):
        for a, b in zip(mine, theirs, strict=True):
            assert torch.equal(a[0, :, :n], b[0, :, :n])


def test_a_batch_row_joining_from_a_cached_prefix_holds_the_bits_of_a_whole_prefill() -> None:
    engine = Engine(bf16_target(), "head")
    engine.generate(PROMPTS[0], max_new_tokens=2)  # the system prompt's blocks are cached
    batch = engine.new_batch(2)
    row = batch.add(engine.request(PROMPTS[3], max_new_tokens=4))
    assert row.stats.cached_tokens == 2 * BLOCK
    prompt = PROMPTS[3][:-1]  # the last token is fed by the first step
    whole = _prefilled(engine.target, prompt)
    n = len(prompt)
    assert batch.target_cache.lengths[row.slot] == n
    for mine, theirs in ((batch.target_cache.keys, whole.keys), (batch.target_cache.values, whole.values)):
        for a, b in zip(mine, theirs, strict=True):
            assert torch.equal(a[row.slot, :, :n], b[0, :, :n])


def test_a_row_copied_from_another_cache_keeps_the_layers_that_have_one() -> None:
    """A staged prefill joins the batch by copy_from. A layer the model never writes (no cache of its own)
    stays empty; the others arrive bitwise."""
    generator = torch.Generator().manual_seed(0)
    keys = [torch.randn(2, 20, 4, generator=generator), None, torch.randn(2, 20, 4, generator=generator)]
    values = [torch.randn(2, 20, 4, generator=generator), None, torch.randn(2, 20, 4, generator=generator)]
    source = kv.BatchCache(3)
    source.write_row(source.add_row(), keys, values)
    batch = kv.BatchCache(3)
    batch.add_row(), batch.add_row()
    batch.copy_from(source, 0, 1)
    assert batch.lengths == [0, 20] and batch.keys[1] is None and batch.values[1] is None
    for layer in (0, 2):
        assert torch.equal(batch.keys[layer][1, :, :20], keys[layer])
        assert torch.equal(batch.values[layer][1, :, :20], values[layer])


# =================================================================================================
# The engine
# =================================================================================================


def test_the_engine_caches_prefixes_only_where_a_split_prefill_was_measured_exact() -> None:
    engine = Engine(bf16_target(), "head")
    assert engine.exactness.exact and engine.exactness.prefix_reuse
    assert engine.prefix_cache is not None and engine.prefix_cache.keep_states  # a head reads the states
    assert Engine(bf16_target(), "early-exit:1").prefix_cache.keep_states is False
    assert Engine(bf16_target(), None, prefix_cache_mb=0).prefix_cache is None
    assert Engine(llama(0), None).prefix_cache is None  # eager fp32: per-shape kernels, every prompt whole


@pytest.mark.parametrize("rows, positions", [(140, 256), (450, 1024)])
def test_a_product_that_rounds_otherwise_past_some_row_count_turns_the_cache_off(monkeypatch, rows, positions) -> None:
    """A product whose rounding follows the row count past `rows` (more than any step or verify the check
    feeds). Past 140 rows, a 150-token context fed whole and in two halves differ. Past 450, only a
    prompt longer than a prefill chunk shows it (512 rows whole, 400 after a cached prefix of 160),
    which a model of 1,024 positions lets the check feed. Either way the check must see it (the steps
    and verifies it compares stay equal)."""
    model = llama(0, init=0.02, positions=positions).to(BF16)
    exact.install(model)
    real = exact.linear

    def long_inputs_round_otherwise(x, weight, bias=None, row_chunk=None):
        out = real(x, weight, bias, row_chunk)
        return out * (1 + 2**-7) if x.reshape(-1, x.shape[-1]).shape[0] > rows else out

    monkeypatch.setattr(exact, "linear", long_inputs_round_otherwise)
    report = exact.check(model)
    assert report.exact and not report.prefix_reuse
    assert "no prefix cache" in report.summary()


@pytest.mark.parametrize("kind", [None, "head", "early-exit:1", "ngram+head"])
def test_bf16_greedy_output_with_cached_prefixes_equals_the_target_alone_without(kind) -> None:
    model = bf16_target()
    alone = Engine(model, None, prefix_cache_mb=0)
    expected = [alone.generate(p, max_new_tokens=14, speculative=False).token_ids for p in PROMPTS]
    engine = Engine(model, kind)
    uncached = Engine(model, kind, prefix_cache_mb=0)
    assert engine.prefix_cache is not None
    for k in (None, 3):  # the second pass finds every prompt's blocks
        for i, prompt in enumerate(PROMPTS):
            out = engine.generate(prompt, max_new_tokens=14, k=k, speculative=kind is not None)
            assert out.token_ids == expected[i], f"k={k} prompt {i}"
            if k == 3 and kind is not None:  # the draft read the same states: it proposed the same tokens
                other = uncached.generate(prompt, max_new_tokens=14, k=k).stats
                assert (out.stats.drafted, out.stats.accepted) == (other.drafted, other.accepted)
            if k is None and i in (1, 2, 3):
                assert out.stats.cached_tokens == 2 * BLOCK  # the shared system prompt came from the cache
            if k == 3:  # every whole block of the prompt but its last token (fed by the first step)
                assert out.stats.cached_tokens == (len(prompt) - 2) // BLOCK * BLOCK
    assert engine.prefix_cache.hits >= 2 * len(PROMPTS) - 1


@pytest.mark.parametrize("kind", ["head", "early-exit:1"])
def test_batched_rows_and_a_staged_prefill_from_cached_prefixes_equal_the_target_alone(kind, monkeypatch) -> None:
    monkeypatch.setattr(feeding, "PREFILL_CHUNK", 8)  # the long prompts are staged a chunk per step
    model = bf16_target()
    alone = Engine(model, None, prefix_cache_mb=0)
    long = SYSTEM + list(range(2, 40))  # 78 tokens
    prompts = [*PROMPTS, long]
    expected = [alone.generate(p, max_new_tokens=10, speculative=False).token_ids for p in prompts]
    engine = Engine(model, kind)
    engine.generate(PROMPTS[0], max_new_tokens=2)  # the system prompt is cached
    batch = engine.new_batch(3)
    outputs, rows, pending, staged = {}, {}, list(range(len(prompts))), 0
    while pending or len(batch):
        while pending and not batch.full:  # rows join as others leave: staggered, some staged
            i = pending.pop(0)
            row = batch.add(engine.request(prompts[i], max_new_tokens=10))
            rows[row] = i
            staged += row in batch.prefills
            assert row.stats.cached_tokens >= (BLOCK if i < len(PROMPTS) else 2 * BLOCK)
        for row, chunk in batch.step():
            if chunk.output is not None:
                outputs[rows.pop(row)] = chunk.output.token_ids
    assert staged >= 1, "no prompt was staged: the chunked path was not tested"
    assert [outputs[i] for i in range(len(prompts))] == expected
