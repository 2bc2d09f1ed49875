"""The C++ attention kernel of the compiled step (`adaptive_spec.kernels.attention_cpu`).

Run: .venv/bin/python -m pytest tests/adaptive_spec/test_attention_cpu.py -q   (builds it once: ~20 s)

What must hold: it computes SDPA's formula (to bf16 rounding: bitwise its own fp32 reference here),
and a query's output is bitwise the same alone, among other queries, in a batch of rows with other
lengths, and over keys that are masked or past its row's context.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from adaptive_spec.kernels import attention_cpu

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def kernel(extensions_dir):
    built = attention_cpu.load(extensions_dir)
    assert built is not None, "the kernel did not build: is g++ installed?"
    return built


def inputs(dtype, n=2, heads=9, kv_heads=3, q=5, d=64, kv_len=300, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(n, heads, q, d, generator=generator).to(dtype)
    key = torch.randn(n, kv_heads, kv_len, d, generator=generator).to(dtype)
    value = torch.randn(n, kv_heads, kv_len, d, generator=generator).to(dtype)
    positions = torch.tensor([[kv_len - q + i for i in range(q)], [100 + i for i in range(q)]])[:n]
    mask = (torch.arange(kv_len)[None, None, :] <= positions[:, :, None])[:, None]  # [n, 1, q, kv_len]
    return query, key, value, mask


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_computes_attention(kernel, dtype) -> None:
    query, key, value, mask = inputs(dtype)
    out = kernel(query, key, value, mask, 0.125)
    assert out.shape == (2, 5, 9, 64) and out.dtype == dtype
    expected = attention_cpu.reference(query, key, value, mask, 0.125)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)


def test_the_kernel_is_an_operator_a_compiled_graph_calls_directly(kernel) -> None:
    """The compiled step calls the kernel as the dispatcher's operator (no Python custom operator around
    it, 5-14 us a call): its fake lets a graph trace it whole, with the same bits as the eager call."""
    assert kernel is torch.ops.adaptive_spec_attention.attention.default
    query, key, value, mask = inputs(torch.bfloat16)
    graph = torch.compile(lambda q, k, v, m: kernel(q, k, v, m, 0.125) * 2, fullgraph=True, dynamic=True)
    assert torch.equal(graph(query, key, value, mask), kernel(query, key, value, mask, 0.125) * 2)


def test_a_querys_output_does_not_depend_on_what_shares_the_call(kernel) -> None:
    query, key, value, mask = inputs(torch.bfloat16)
    together = kernel(query, key, value, mask, 0.125)
    # row 1 alone, over only the 128 keys its mask can reach
    alone = kernel(query[1:], key[1:, :, :128], value[1:, :, :128], mask[1:, :, :, :128], 0.125)
    assert torch.equal(alone[0], together[1])
    # its third query alone, over every key
    single = kernel(query[1:, :, 2:3], key[1:], value[1:], mask[1:, :, 2:3], 0.125)
    assert torch.equal(single[0, 0], together[1, 2])
    # a tree-like mask: a query that skips a key in the middle equals one over the keys without it
    skipping = mask[1:, :, :1].clone()
    skipping[..., 50] = False
    kept = [j for j in range(300) if j != 50]
    gapped = kernel(query[1:, :, :1], key[1:], value[1:], skipping, 0.125)
    packed = kernel(query[1:, :, :1], key[1:, :, kept], value[1:, :, kept], skipping[..., kept], 0.125)
    assert torch.equal(gapped, packed)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_steps_few_queries_a_task_each_equal_themselves_in_blocks_of_sixteen(kernel, threads) -> None:
    """1 row x 9 queries over 3 kv heads makes too few tasks of 16 queries for the threads, so each query is a
    task of its own; among 8 rows the same queries go in blocks of 16. The same bits either way. The queries
    reach different blocks of keys (the first 20, the last 300), so a later task must convert keys an earlier
    one on its thread did not reach."""
    query, key, value, _ = inputs(torch.bfloat16, n=1, q=9)
    reach = torch.tensor([19, 299, 40, 75, 120, 130, 200, 260, 280])  # each query's last key, out of order
    mask = (torch.arange(300)[None, :] <= reach[:, None])[None, None]  # [1, 1, 9, 300]
    many = [t.expand(8, *t.shape[1:]).contiguous() for t in (query, key, value, mask)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = kernel(query, key, value, mask, 0.125)
        together = kernel(*many, 0.125)
    finally:
        torch.set_num_threads(before)
    for row in range(8):
        assert torch.equal(together[row], alone[0]), f"row {row}"


def test_a_prompts_queries_equal_themselves_one_at_a_time_whatever_lies_out_of_sight(kernel) -> None:
    """A prefill of 40 queries (three tasks of 16) over a cache whose spare capacity holds NaN and
    infinities: each query's output is bitwise its output alone, and finite."""
    query, key, value, _ = inputs(torch.bfloat16, n=1, q=40, kv_len=64)
    key[:, :, 40:48], value[:, :, 40:48] = float("nan"), float("nan")
    key[:, :, 48:], value[:, :, 48:] = float("inf"), float("-inf")
    mask = (torch.arange(64)[None, :] <= torch.arange(40)[:, None])[None, None]  # causal over the first 40
    together = kernel(query, key, value, mask, 0.125)
    assert torch.isfinite(together).all()
    for i in range(40):
        alone = kernel(query[:, :, i : i + 1], key, value, mask[:, :, i : i + 1], 0.125)
        assert torch.equal(alone[0, 0], together[0, i]), f"query {i}"
    expected = attention_cpu.reference(query, key[:, :, :40], value[:, :, :40], mask[..., :40], 0.125)
    torch.testing.assert_close(together.float(), expected.float(), atol=1e-2, rtol=1e-2)


def test_values_read_in_place_or_copied_out_give_the_same_bits(kernel) -> None:
    """bf16 values with contiguous rows are read where they lie; any other layout is first copied out
    in fp32. Both are the same numbers, so the same output, bit for bit."""
    query, key, value, mask = inputs(torch.bfloat16)
    strided = value.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, last dimension strided
    assert strided.stride(-1) != 1
    assert torch.equal(kernel(query, key, strided, mask, 0.125), kernel(query, key, value, mask, 0.125))


@pytest.mark.parametrize("d", [64, 128])
def test_keys_converted_sixteen_at_a_time_or_one_by_one_give_the_same_bits(kernel, d) -> None:
    """bf16 keys with contiguous rows are converted a block of 16 at a time (a transpose in registers);
    any other layout, and a context's last partial block (300 keys: 18 blocks and 12), one key at a
    time. The same numbers land in the same places, so the output is the same, bit for bit."""
    query, key, value, mask = inputs(torch.bfloat16, d=d)
    strided = key.transpose(-1, -2).contiguous().transpose(-1, -2)  # same keys, last dimension strided
    assert strided.stride(-1) != 1
    assert torch.equal(kernel(query, strided, value, mask, 0.125), kernel(query, key, value, mask, 0.125))


def test_both_extensions_build_once_in_one_directory(extensions_dir, kernel) -> None:
    """The attention and linear kernels in one build directory, as a server's data directory keeps them
    (compile/extensions): building them again compiles neither. torch writes an extension's main.cpp and
    build.ninja into its build directory, and the two used to share one, so each overwrote the other's
    and every start rebuilt both (about 36 s on 2 cores). In a process of its own: the linear kernel
    registers an operator library, and importing it from a second directory in this process (where
    another test may have loaded it) aborts."""
    script = f"""
import sys
from pathlib import Path
from adaptive_spec.kernels import attention_cpu, linear_bf16
directory = Path({str(extensions_dir)!r})
builds = {{
    "adaptive_spec_attention_cpu": lambda: attention_cpu.build_attention(directory),
    "adaptive_spec_linear_bf16": lambda: linear_bf16.build(directory),
}}
so = lambda name: (directory / name / f"{{name}}.so").stat().st_mtime_ns
built = {{}}
for name, build in builds.items():  # the first may compile (the linear kernel: nothing built it here yet)
    build()
    built[name] = so(name)
for name, build in builds.items():
    build()
    if so(name) != built[name]:
        sys.exit(f"{{name}} was built again")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("kept", [1, 7, 8, 9, 16, 23])
def test_the_largest_score_counts_wherever_it_sits_among_the_kept_keys(kernel, kept) -> None:
    """The softmax's largest score is taken over 8 running maxima and a tail; one key far above the others,
    at each kept position in turn (among masked keys in between), must take all the weight. A maximum
    missed there would let exp_fixed clip the key at 1 beside the others: an average of values instead."""
    kv_len = 2 * kept + 3
    allowed = torch.zeros(kv_len, dtype=torch.bool)
    allowed[1::2][:kept] = True  # every other key, so the kept ones are not a contiguous run
    positions = allowed.nonzero().flatten().tolist()
    query = torch.zeros(1, 1, 1, 16)
    query[..., 0] = 1.0
    for winner in positions:
        key = torch.zeros(1, 1, kv_len, 16)
        key[0, 0, winner, 0] = 200.0  # a score of 200 * scale = 100 above every other key's 0
        value = torch.randn(1, 1, kv_len, 16, generator=torch.Generator().manual_seed(winner))
        out = kernel(query, key, value, allowed.view(1, 1, 1, kv_len), 0.5)
        torch.testing.assert_close(out[0, 0, 0], value[0, 0, winner], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("context", [1, 7, 8, 9, 16, 17, 200])
def test_a_short_rows_output_does_not_depend_on_the_caches_capacity(kernel, context) -> None:
    """A long prompt leaves the batch's cache long: a short row's query then sees `context` keys of
    thousands. The keys past its last visible one are skipped 8 mask bytes at a time and the scratch
    grows with the keys reached, so its output is bitwise the one over a cache just its size, with a
    contiguous mask or a broadcast one (stride 0, read a byte at a time), beside a row that sees all."""
    query, key, value, _ = inputs(torch.bfloat16, n=2, q=1, kv_len=4096)
    mask = torch.zeros(2, 1, 1, 4096, dtype=torch.bool)
    mask[0, ..., :context] = True
    mask[1] = True
    together = kernel(query, key, value, mask, 0.125)
    short = kernel(query[:1], key[:1, :, :context], value[:1, :, :context], mask[:1, ..., :context], 0.125)
    assert torch.equal(together[0], short[0])
    broadcast = mask[:1, :, :, :1].expand(1, 1, 1, context)  # every key visible, through a stride-0 mask
    assert broadcast.stride(-1) == 0 or context == 1
    assert torch.equal(kernel(query[:1], key[:1, :, :context], value[:1, :, :context], broadcast, 0.125), short)
    torch.testing.assert_close(
        together.float(), attention_cpu.reference(query, key, value, mask, 0.125).float(), atol=1e-2, rtol=1e-2
    )


@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (6, 3), (8, 2), (5, 1), (9, 3)])
def test_every_size_of_a_kv_group_is_scored_as_its_own_heads(kernel, heads, kv_heads) -> None:
    """A query's heads sharing a kv head are scored in one pass over its keys, up to 4 heads at a time (a
    group of 5: 4, then 1): each head's output is still its own attention, and bitwise its output when it
    is the only head of its group."""
    query, key, value, mask = inputs(torch.bfloat16, heads=heads, kv_heads=kv_heads, q=3)
    out = kernel(query, key, value, mask, 0.125)
    expected = attention_cpu.reference(query, key, value, mask, 0.125)
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-2, rtol=1e-2)
    groups = heads // kv_heads
    for h in range(heads):
        g = h // groups
        alone = kernel(query[:, h : h + 1], key[:, g : g + 1], value[:, g : g + 1], mask, 0.125)
        assert torch.equal(alone[:, :, 0], out[:, :, h]), f"head {h}"


def test_a_lock_left_by_a_build_that_died_does_not_stop_the_next_start(kernel, extensions_to_ourselves):
    """torch takes turns building through a `lock` file it deletes when done. A process ended mid-build
    (`serve` stopped while its models load exits with os._exit) left it, and every later start waited for
    it forever. Now whoever holds the directory's `.builder` lock (the kernel drops it when its holder
    dies) removes a `lock` it finds. In a process of its own, as a next start would be; the other worker
    keeps out of the directory meanwhile (its `kernels` would remove the lock first)."""
    extensions_dir = extensions_to_ourselves
    directory = extensions_dir / "adaptive_spec_attention_cpu"
    (directory / "lock").touch()  # what a builder killed mid-build leaves
    script = f"""
from pathlib import Path
from adaptive_spec.kernels import attention_cpu
attention_cpu.build_attention(Path({str(extensions_dir)!r}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "left by a build that did not finish" in done.stderr
    assert not (directory / "lock").exists()
