"""A batch-invariant attention kernel in C++ for the CPU, built at run time, for the compiled step.

exact.attention gets its invariance from PyTorch operators arranged in a fixed order (fp32 products
in blocks of 128 keys), at the price of about 25 operators per layer: on the default model 4-7 ms of
a 22 ms compiled step went to them. This kernel computes the same thing in one call per layer, with
every reduction in an order fixed by the code alone, so a query's result cannot depend on what else
shares the call:

    for each (row, kv head, block of 16 queries or one):    # parallel over these, each independent
      for each query, and each head sharing the kv head:
        s[j] = scale * dot(q, k[j])   dot: 8 partial sums (dimension t into sum t % 8), then summed in order
        m = max s over the keys j the mask allows; e[j] = exp(s[j] - m)    (a fixed polynomial exp)
        out = (sum_j e[j] * v[j]) / (sum_j e[j])    j ascending over the allowed keys only

The work is laid out for SIMD without letting it decide a result: keys are scored 16 at a time, one
key per vector element (keys stored transposed, [block][dimension][16]), and every operation is
a single IEEE operation per element (compiled with -ffp-contract=off, so no multiply-add is fused
behind the code's back; the exp is built from such operations too, so its vector and scalar forms
agree). Which block or element a key lands in, how many queries or rows share the call, and
whether the compiler vectorized a loop change nothing in its bits. Skipping a masked key is the
same as adding its exact zero, so keys past a row's own context (other rows' longer contexts, the
cache's spare capacity) change nothing; the arithmetic is bf16 or fp32 inputs with fp32
accumulation, as SDPA's. It is not bitwise the same as exact.attention (another summation order),
which is why a model uses one or the other for all its steps: the compiled step uses this one when
it builds, and exact.check measures the result like any other path.

Tasks of 16 queries spread a prompt's prefill over the threads (a row and kv head per task left
one of two cores idle on the default model's 3 kv heads). Against the first version of this kernel
(one key at a time, its 16 partial sums added one by one), on the default model's shapes, 2 cores:
a 512-token prefill's layer 8.3 -> 2.6 ms, a verify of 5 tokens over 600 keys 0.15 -> 0.07 ms, a
plain step 0.07 -> 0.04 ms. Each task converts only the keys its queries reach (the cache's spare
capacity past them used to be converted too, half of it or more), and bf16 values are widened as
they are read instead of copied out: 8 rows x 1 query over 128 of 256 cached keys 78 -> 47 us
(1024 cached: 239 -> 51 us), and in the compiled step of 8 rows x 1 token 153 -> 107 us a layer,
the step 17.2 -> 15.7 ms (AMD EPYC Zen 5, 2 cores). In a step each layer's cache comes from memory,
so keys and values are prefetched AHEAD keys before their conversion: over 30 layers' caches in turn,
70 -> 54 us a layer (80 -> 58 us with the caches evicted first). bf16 keys with contiguous rows are
converted sixteen at a time, a 16 x 16 transpose in registers instead of a scattered store per value
(the same numbers in the same places): over 30 layers' caches, 1 row x 2 queries over 500 keys
44.9 -> 33.6 us a layer, 4 rows x 2 over 300 keys 80.4 -> 68.6, 8 rows x 2 over 300 keys 159 -> 146,
1 row x 2 over 1,500 keys 129 -> 103; a prompt's prefill unchanged (its queries outweigh the keys).
The largest kept score is taken over 8 running maxima instead of one chain of dependent maxima, which
`perf` showed holding an eighth of the kernel's time (the same top: a maximum is exact in any grouping;
bitwise the same outputs as before in 300 random cases of rows, heads, masks and NaN keys). Over 30
layers' caches, old and new interleaved (Intel Xeon without AMX, 2 cores): 1 row x 1 query over 128 of
256 keys 16.7 -> 15.5 us a layer, 8 x 1 over 128 80.7 -> 70.7, 8 x 1 over 1,000 650 -> 619, 4 x 5 over 300
327 -> 288. What is left at many keys is the keys' conversion, the scores and the weighted sum, in
about equal parts; the cache is mostly read from the L3 (the same layer over and over: 8 x 1 over
1,000 keys 555 against 740 us). The scores of a query's heads in one pass over its keys (the same sums in
the same order; each head read every key on its own): 8 x 1 over 1,000 keys 606 -> 562 us, 4 x 5 over
300 keys 285 -> 249, a prompt's 512-query chunk over 4,096 keys 77.4 -> 66.7 ms a layer.

A batch's cache keeps the capacity its longest row ever needed (a 4k-token prompt: 4096 positions for
every row, for good), and each call used to zero a scratch of that whole capacity and scan every query's
mask to its end. The scratch now grows with the keys reached, and a mask's trailing keys out of sight are
skipped 8 bytes at a time (the same outputs bitwise, in 300 random cases of capacities up to 4096 with rows
cut short). A query over 128 keys in a capacity of 4096: 1 row 44.0 -> 16.6 us a layer, 8 rows 122.3 ->
76.6; in the compiled step of the default model after 128 cached tokens, 1 row 16.8 -> 15.1 ms and 8
rows 27.5 -> 25.2 (with a capacity of 256: 15.0 and 25.0 ms, unchanged).

A step's few queries used to go in one task of 16 per (row, kv head): one row's verify of 9 tokens over the
default model's 3 kv heads made 3 tasks for 2 threads, one thread doing two of them. Where blocks of 16 would
make fewer than 4 tasks a thread, each query is now a task (the same outputs: a query's result never depended on
its task). Over 30 layers' caches of 300 keys, 2 threads, old and new side by side (Intel Xeon with AMX, on an
hour when its memory read 8 GB/s, so slow in absolute terms): 1 row x 5 queries 218-239 -> 190-195 us a layer,
x 9 342-417 -> 301-326, x 17 551-644 -> 495-507; 1 x 1, 4 x 5 and 8 x 1 unchanged (their tasks were enough).

    from adaptive_spec.kernels import attention_cpu
    kernel = attention_cpu.load(build_dir)   # None when no C++ compiler is at hand (then exact.attention)
    out = kernel(query, key, value, mask, scale)   # [n, heads, q, d] ... -> [n, q, heads, d]

The C++ is `attention_cpu.cpp` beside this module; building it (`build.py`) takes about 20 s once per
machine (cached in `build_dir`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from adaptive_spec.kernels.build import build_extension
from adaptive_spec.options import CoreSettings

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("attention_cpu.cpp")  # the kernel's C++, installed beside this module

_loaded: dict[str, object] = {}


def load(build_dir: Path | str | None = None):
    """The compiled kernel as the dispatcher's operator `attention(query, key, value, mask, scale)`
    (`torch.ops.adaptive_spec_attention.attention`, with the fake that tracing needs), or None where it
    cannot be built (no C++ compiler, or ADAPTIVE_SPEC_CPU_ATTENTION=0)."""
    if not CoreSettings.from_env().cpu_attention:
        return None
    key = "kernel"  # one build per process, wherever the first caller keeps it
    if key not in _loaded:
        try:
            build_attention(build_dir)
            _loaded[key] = _operator()
        except Exception as exc:  # no compiler, no headers: the operator version serves
            log.warning("the C++ attention kernel could not be built (%s); using exact.attention", exc)
            _loaded[key] = None
    return _loaded[key]


def build_attention(build_dir: Path | str | None = None):
    """Build (or load from `build_dir`) this kernel's extension: its `attention` is the pybind function, and
    loading it registers the operator that `load` gives. A process loads it from one directory only (a
    second registration of the operator aborts)."""
    return build_extension("adaptive_spec_attention_cpu", _SOURCE.read_text(encoding="utf-8"), ["attention"], build_dir)


def _operator():
    """The kernel as the dispatcher's operator, with its fake (registered once: `load` caches it)."""
    operator = torch.ops.adaptive_spec_attention.attention.default

    @torch.library.register_fake("adaptive_spec_attention::attention")
    def _(query, key, value, mask, scale):
        n, heads, q, d = query.shape
        return query.new_empty((n, q, heads, d))

    return operator


def reference(query, key, value, mask, scale) -> torch.Tensor:
    """The kernel's formula in PyTorch (fp32), for tests."""
    groups = query.shape[1] // key.shape[1]
    keys = key.float().repeat_interleave(groups, dim=1)
    values = value.float().repeat_interleave(groups, dim=1)
    scores = (query.float() @ keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ values).transpose(1, 2).to(query.dtype)
