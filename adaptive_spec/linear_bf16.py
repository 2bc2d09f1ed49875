"""A batch-invariant bf16 matrix product in C++ for the CPU (AVX512-BF16), for the compiled step.

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
through the compiled step, and every prefill must take one path (kv._compiled_prefill).

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

    from adaptive_spec import linear_bf16
    kernel = linear_bf16.load(build_dir)   # None without AVX512-BF16 or a C++ compiler (then F.linear)
    y = kernel(x, weight, bias)           # x [m, k] bf16, weight [n, k] bf16, bias [n] or None

`kernel` is the operator `torch.ops.adaptive_spec_kernels.linear_bf16` (with a fake for tracing), which
is what a compiled graph calls.

Building takes about 20 s once per machine (cached in `build_dir`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from adaptive_spec import attention_cpu
from adaptive_spec.options import CoreSettings

log = logging.getLogger(__name__)

PREFETCH_ROWS = 16  # weight rows prefetched ahead of the ones being read (16-32 measured best here)

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
// PREFETCH_ROWS comes from the build (linear_bf16.PREFETCH_ROWS)

bool available() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

#ifdef __AVX512BF16__
// Rows m0..m0+MB of x against weight rows n0..n0+NB: MB * NB independent dot products, each with
// its own accumulator, so the block shape decides only how many run side by side, never a result.
// The first block of rows prefetches the weight rows PREFETCH_ROWS ahead (into L2); later blocks of
// the same columns find them cached.
template <int MB, int NB>
static inline void block(const at::BFloat16* x, const at::BFloat16* w, const float* bias, at::BFloat16* y,
                         int64_t K, int64_t N, int64_t m0, int64_t n0) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; i++)
    for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
  const bool prefetch = m0 == 0;
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh wv[NB], xv[MB];
    for (int j = 0; j < NB; j++) wv[j] = (__m512bh)_mm512_loadu_si512((const void*)(w + (n0 + j) * K + k));
    for (int j = 0; j < NB; j++)
      if (prefetch && n0 + j + PREFETCH_ROWS < N) _mm_prefetch((const char*)(w + (n0 + j + PREFETCH_ROWS) * K + k), _MM_HINT_T1);
    for (int i = 0; i < MB; i++) xv[i] = (__m512bh)_mm512_loadu_si512((const void*)(x + (m0 + i) * K + k));
    for (int i = 0; i < MB; i++)
      for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[i], wv[j]);
  }
  if (k < K) {  // the tail, zero-padded: zeros add exact zeros
    __mmask32 mask = (__mmask32)((1ull << (K - k)) - 1);
    __m512bh wv[NB], xv[MB];
    for (int j = 0; j < NB; j++) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, (const void*)(w + (n0 + j) * K + k));
    for (int i = 0; i < MB; i++) xv[i] = (__m512bh)_mm512_maskz_loadu_epi16(mask, (const void*)(x + (m0 + i) * K + k));
    for (int i = 0; i < MB; i++)
      for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[i], wv[j]);
  }
  for (int i = 0; i < MB; i++)
    for (int j = 0; j < NB; j++) {
      float sum = _mm512_reduce_add_ps(acc[i][j]);
      if (bias != nullptr) sum = sum + bias[n0 + j];
      y[(m0 + i) * N + n0 + j] = at::BFloat16(sum);
    }
}

// Every row of x against the NB weight rows from n0: blocks of 8 rows, then one block of the rest,
// so each weight row is read from memory once and the accumulators fill the registers.
template <int NB>
static void columns(const at::BFloat16* x, const at::BFloat16* w, const float* bias, at::BFloat16* y,
                    int64_t M, int64_t K, int64_t N, int64_t n0) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) block<8, NB>(x, w, bias, y, K, N, m, n0);
  switch (M - m) {
    case 7: block<7, NB>(x, w, bias, y, K, N, m, n0); break;
    case 6: block<6, NB>(x, w, bias, y, K, N, m, n0); break;
    case 5: block<5, NB>(x, w, bias, y, K, N, m, n0); break;
    case 4: block<4, NB>(x, w, bias, y, K, N, m, n0); break;
    case 3: block<3, NB>(x, w, bias, y, K, N, m, n0); break;
    case 2: block<2, NB>(x, w, bias, y, K, N, m, n0); break;
    case 1: block<1, NB>(x, w, bias, y, K, N, m, n0); break;
  }
}
#endif

torch::Tensor linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
#ifdef __AVX512BF16__
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "x [m, k] and weight [n, k]");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  auto y = torch::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return y;
  torch::Tensor b;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(torch::kFloat).contiguous();
    bp = b.data_ptr<float>();
  }
  const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = wc.data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  // Up to 4 rows: 4 weight rows a block (at most 16 accumulators); more rows: 2 weight rows against
  // blocks of 8 (16 accumulators, each weight vector used 8 times).
  const int64_t width = M <= 4 ? 4 : 2;
  const int64_t blocks = N / width;
  at::parallel_for(0, blocks, 64 / width, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; blk++) {
      if (width == 4) columns<4>(xp, wp, bp, yp, M, K, N, blk * 4);
      else columns<2>(xp, wp, bp, yp, M, K, N, blk * 2);
    }
  });
  for (int64_t n = blocks * width; n < N; n++) columns<1>(xp, wp, bp, yp, M, K, N, n);
  return y;
#else
  TORCH_CHECK(false, "built without AVX512-BF16");
  return x;
#endif
}

// Also an operator of the dispatcher, so that a compiled step calls it with no Python in between
// (a Python custom operator cost about 8 us a call, 211 calls a step).
TORCH_LIBRARY(adaptive_spec_kernels, m) { m.def("linear_bf16(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }
TORCH_LIBRARY_IMPL(adaptive_spec_kernels, CPU, m) { m.impl("linear_bf16", &linear); }
"""

_loaded: dict[str, object] = {}


def load(build_dir: Path | str | None = None):
    """The kernel's `linear(x, weight, bias)`, or None where it cannot serve: a CPU without AVX512-BF16,
    no C++ compiler, or ADAPTIVE_SPEC_CPU_BF16_LINEAR=0."""
    if not CoreSettings.from_env().cpu_bf16_linear:
        return None
    key = "kernel"  # one build per process, wherever the first caller keeps it
    if key not in _loaded:
        _loaded[key] = None
        try:
            module = build(build_dir)
            if module.available():
                _loaded[key] = _operator()
            else:
                log.info("this CPU has no AVX512-BF16: the compiled step's products stay PyTorch's")
        except Exception as exc:  # no compiler, no headers: PyTorch's product serves
            log.warning("the C++ linear kernel could not be built (%s); using F.linear", exc)
    return _loaded[key]


def build(build_dir: Path | str | None = None):
    """Build (or load from `build_dir`) the extension; its `available()` says whether the CPU runs it.
    The product itself is called as the dispatcher's operator (`_operator`)."""
    return attention_cpu.build(
        "adaptive_spec_linear_bf16", SOURCE, ["available"], build_dir, (f"-DPREFETCH_ROWS={PREFETCH_ROWS}",)
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
