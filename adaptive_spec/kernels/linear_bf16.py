"""A batch-invariant bf16 matrix product in C++ for the CPU (AVX512-BF16 or AMX), for the compiled step.

A decoding step of the default model is 211 matrix products of a few rows (2 to about 40: rows of the
batch times tokens per row) by the layers' weights, and it is bound by reading those weights (270 MB
in bf16). PyTorch's bf16 product (oneDNN) read them at 13-21 GB/s here for 2-16 rows, where the
machine streams 50-65 GB/s on 2 cores (`tensor.sum()` over the same bytes): the products were 15 of
a 22 ms step. This kernel reads each weight row once per call, the next rows prefetched ahead of
use, and computes every output from its input row and weight row alone:

    y[m, n] = round_bf16( bias[n] + sum over k of x[m, k] * w[n, k] )
    the sum: 16 fp32 lanes, lane j takes the pairs (2j, 2j + 1) of each block of 32 k's in order
    (vdpbf16ps), the blocks one after another, a short tail zero-padded; then the lanes added in
    the fixed order of _mm512_reduce_add_ps.

Nothing in that depends on how many rows share the call, where a row sits in it, or how the outputs
are split between threads, so a row's result is bitwise the same alone or in any batch. It is not
bitwise oneDNN's product (another summation order), which is why the compiled step uses it for
every product of every step and prefill and exact.check measures the result as for any path. For a
prefill's many rows PyTorch's kernel is somewhat faster (compute-bound: 512 tokens 1.01 against 1.09 s
on an Intel Xeon without AMX), but a prompt's tail after a cached prefix (1-16 tokens) runs 2-3x faster
through the compiled step, and every prefill must take one path (feeding._compiled_prefill).

Measured on this machine (AMD EPYC Zen 5, 2 cores; default model's 211 products plus the LM head,
distinct weights, best of 5): 2 rows 13.2 -> 7.5 ms, 8 rows 14.5 -> 7.2 ms, 16 rows 16.8 -> 9.6 ms,
32 rows 21.8 -> 17.2 ms. Software prefetch made the difference: without it the same loop ran at
oneDNN's speed.

The blocking: up to 4 rows, blocks of 4 weight rows by all the rows; more rows, blocks of 2 weight
rows by 8 rows, then one block of the remaining rows (not a block per remaining row), so a weight
row is read from memory once per call and the accumulators fill the registers. Only the first block
of rows prefetches, into L2. Measured on an Intel Xeon with AVX512-BF16 and no AMX (2 cores, the
same 211 products, best of 9, interleaved, 2026-11-27), where a vdpbf16ps issues about once per 2.5
cycles (0.94 G/s on one core, against 2.1 G/s for a 512-bit FMA), so 8 or more rows are bound by the
arithmetic, not the memory: against the earlier blocking of 4 x 4 with one block per remaining row
and prefetch into L1 from every block, 1 row 9.7 -> 9.7 ms, 2 rows 11.4 -> 9.9, 3 rows 13.5 -> 10.7,
5 rows 14.7 -> 12.6, 8 rows 20.4 -> 16.9, 16 rows 35.1 -> 31.6, 40 rows 80.5 -> 76.3. Every output
is bitwise the earlier kernel's (same sums in the same order; compared on the model's shapes and on
tails, 1 to 41 rows, with and without bias).

On a CPU with AMX-BF16 (Intel Xeon since Sapphire Rapids) the products run on AMX tiles instead, unless
ADAPTIVE_SPEC_CPU_AMX=0: y^T = W x^T, an A tile 16 weight rows x 32 k's read in place (the weight is not
repacked), a B tile the same 32 k's of up to 16 rows of x in pairs, and each output one tile accumulator:

    y[m, n] = round_bf16( bias[n] + sum over k of x[m, k] * w[n, k] )
    the sum: from zero, 32 k's at a time in order (TDPBF16PS, which adds a pair of products at a time)

As above, nothing depends on the rows that share the call (a tile holds 16 rows of x whatever M is, zeros
past it), so a row is bitwise the same alone or in a batch; it is not bitwise the AVX512-BF16 order, so
a process takes one of the two for all its products (`set_amx`, once, at `load`). A weight whose k is not
a multiple of 32 takes AVX512-BF16 in both (decided by its shape, never by the rows). Measured on an Intel
Xeon with AMX-BF16 (2 cores, 2026-11-30), a target forward of the default model over 128 cached tokens, ms,
AMX against AVX512-BF16, two rounds each in one process: 1 row x 1 token 18.0-18.3 against 17.1-17.6; 1 x 5
20.9-21.6 against 21.6-21.7; 1 x 9 22.9-23.4 against 27.1-28.4; 1 x 17 30.6-31.1 against 42.9-43.0; 8 x 1
23.2-23.6 against 24.6-25.7; 4 x 5 31.4-33.1 against 45.5-47.6; 8 x 5 48.0-49.2 against 84.0-86.7; 8 x 9
71.5-74.3 against 142.1-145.1. A plain step of one row is about 4% dearer (reading the weights bounds it
either way, and 16 weight rows read side by side stream less well than 4); every verify of 5 tokens or more
and every batch of 8 rows costs the same or less, up to half. Releasing the tiles after each call (then
configuring them again) cost about 2 ms a step and is not done.

    from adaptive_spec.kernels import linear_bf16
    kernel = linear_bf16.load(build_dir)   # None without AVX512-BF16 or a C++ compiler (then F.linear)
    y = kernel(x, weight, bias)           # x [m, k] bf16, weight [n, k] bf16, bias [n] or None
    linear_bf16.uses_amx()                # whether this process's products run on AMX tiles

`kernel` is the operator `torch.ops.adaptive_spec_kernels.linear_bf16` (with a fake for tracing), which
is what a compiled graph calls.

The C++ is `linear_bf16.cpp` beside this module; building it (`build.py`) takes about 20 s once per
machine (cached in `build_dir`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from adaptive_spec.kernels.build import build_extension
from adaptive_spec.options import CoreSettings

log = logging.getLogger(__name__)

PREFETCH_ROWS = 16  # weight rows prefetched ahead of the ones being read (16-32 measured best here)

_SOURCE = Path(__file__).with_name("linear_bf16.cpp")  # the kernel's C++, installed beside this module

_loaded: dict[str, Any] = {}  # "kernel": the operator or None; "module": the built extension


def load(build_dir: Path | str | None = None):
    """The kernel's `linear(x, weight, bias)`, or None where it cannot serve: a CPU without AVX512-BF16,
    no C++ compiler, or ADAPTIVE_SPEC_CPU_BF16_LINEAR=0. On a CPU with AMX-BF16 its products run on AMX
    tiles unless ADAPTIVE_SPEC_CPU_AMX=0 (`uses_amx`), decided once per process."""
    settings = CoreSettings.from_env()
    if not settings.cpu_bf16_linear:
        return None
    key = "kernel"  # one build per process, wherever the first caller keeps it
    if key not in _loaded:
        _loaded[key] = None
        try:
            module = build(build_dir)
            if module.available():
                _loaded[key] = _operator()
                _loaded["module"] = module
                if module.set_amx(settings.cpu_amx):
                    log.info("bf16 products on AMX tiles (ADAPTIVE_SPEC_CPU_AMX=0: AVX512-BF16 instead)")
            else:
                log.info("this CPU has no AVX512-BF16: the compiled step's products stay PyTorch's")
        except Exception as exc:  # no compiler, no headers: PyTorch's product serves
            log.warning("the C++ linear kernel could not be built (%s); using F.linear", exc)
    return _loaded[key]


def uses_amx() -> bool:
    """Whether this process's bf16 products run on AMX tiles (after `load`)."""
    module = _loaded.get("module")
    return bool(module is not None and module.amx_enabled())


def set_amx(wanted: bool) -> bool:
    """Switch the loaded kernel between AMX tiles and AVX512-BF16 (tests, `bench`'s side-by-side paths);
    returns whether AMX serves. Outputs differ in the last bits between the two, so a process serves with
    one: switch only between runs, never while a model decodes."""
    module = _loaded.get("module")
    if module is None:
        return False
    return bool(module.set_amx(wanted))


def build(build_dir: Path | str | None = None):
    """Build (or load from `build_dir`) the extension; its `available()` says whether the CPU runs it.
    The product itself is called as the dispatcher's operator (`_operator`)."""
    return build_extension(
        "adaptive_spec_linear_bf16",
        _SOURCE.read_text(encoding="utf-8"),
        ["available", "set_amx", "amx_enabled"],
        build_dir,
        (f"-DPREFETCH_ROWS={PREFETCH_ROWS}",),
    )


def _operator():
    """The kernel as the dispatcher's operator, with the fake that tracing needs (registered once)."""
    operator = torch.ops.adaptive_spec_kernels.linear_bf16.default

    @torch.library.register_fake("adaptive_spec_kernels::linear_bf16")
    def _(x, weight, bias):
        return x.new_empty((x.shape[0], weight.shape[0]))

    return operator


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's formula in PyTorch (fp32 products and sums, another order), for tests."""
    out = x.float() @ weight.float().t()
    return (out if bias is None else out + bias.float()).to(x.dtype)
