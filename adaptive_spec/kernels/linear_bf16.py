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

Building takes about 20 s once per machine (cached in `build_dir`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from adaptive_spec.kernels import attention_cpu
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

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

static bool use_amx = false;  // set once per process (set_amx), before the first product

// On a CPU with AMX-BF16 (Intel Xeon since Sapphire Rapids), products may run on its tiles instead:
// returns whether they will. Linux lends the tiles' state only to a process that asks for it.
bool set_amx(bool wanted) {
#ifdef HAVE_AMX
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  if (wanted && !permitted) TORCH_WARN_ONCE("Linux refused this process the AMX tiles (arch_prctl); AVX512-BF16 serves");
  use_amx = wanted && permitted;
#else
  use_amx = false;
#endif
  return use_amx;
}

bool amx_enabled() { return use_amx; }

#ifdef HAVE_AMX
struct TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Every tile 16 rows of 64 bytes: a C tile holds 16 weight rows x 16 rows of x in fp32, an A tile 16 weight
// rows x 32 k's, a B tile 16 pairs of k's x 16 rows of x (each row's two bf16 side by side).
// Loaded at every call: another library (oneDNN) may configure or release a thread's tiles in between. Not
// released after: a release then a load cost about 2 ms a decoding step here. A caller that trusts a thread's
// tiles to keep its own configuration between its calls without loading it again (PyTorch's cpublas brgemm
// where it releases only on the calling thread: inductor's int8 attention template) would find this one; no
// path of this project's runs such a caller.
static void configure_tiles() {
  TileConfig config = {};
  config.palette_id = 1;
  for (int t = 0; t < 8; t++) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// y for the rows of a C tile: tile[r][c] is output n0 + r of row m0 + c of x
static inline void store_tile(const float* tile, const float* bias, at::BFloat16* y, int64_t N, int64_t n0,
                              int64_t m0, int64_t rows_n, int64_t rows_m) {
  for (int64_t r = 0; r < rows_n; r++)
    for (int64_t c = 0; c < rows_m; c++) {
      float sum = tile[r * 16 + c];
      if (bias != nullptr) sum = sum + bias[n0 + r];
      y[(m0 + c) * N + n0 + r] = at::BFloat16(sum);
    }
}

// The product on AMX tiles (K a multiple of 32). Each output is one tile accumulator's sum: k in order,
// a pair at a time (TDPBF16PS), from zero, then the bias, then one rounding. A weight row and a row of x
// alone decide it; the number of rows, their place and the threads decide only which tile computes it.
// A pass takes 2 blocks of 16 weight rows against 1 block of 16 rows of x, or against 2 when there are more,
// so a weight tile is loaded once per 32 rows of x (the next weight rows then prefetched into L2).
static void amx_linear(const at::BFloat16* xs, const at::BFloat16* wp, const float* bias, at::BFloat16* yp,
                       int64_t M, int64_t K, int64_t N, const at::BFloat16* wtail) {
  const int64_t KT = K / 32, MB = (M + 15) / 16, NB = N / 16, tail = N % 16;
  // x in pairs: for block mb and pair kk, 16 rows x 2 bf16 (zeros past M)
  std::vector<at::BFloat16> packed(MB * (K / 2) * 32, at::BFloat16(0.0f));
  for (int64_t m = 0; m < M; m++)
    for (int64_t kk = 0; kk < K / 2; kk++) {
      at::BFloat16* to = packed.data() + ((m / 16) * (K / 2) + kk) * 32 + 2 * (m % 16);
      to[0] = xs[m * K + 2 * kk];
      to[1] = xs[m * K + 2 * kk + 1];
    }
  const at::BFloat16* xp = packed.data();
  const int64_t stride = K * 2, blocks = NB + (tail ? 1 : 0);
  auto weights = [&](int64_t nb) { return nb < NB ? wp + nb * 16 * K : wtail; };
  const int64_t per = 2;
  const int64_t groups = (blocks + per - 1) / per;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    configure_tiles();
    alignas(64) float out[4][256];
    for (int64_t g = g0; g < g1; g++) {
      const int64_t nb0 = g * per, count = std::min<int64_t>(per, blocks - nb0);
      const at::BFloat16* ws[2];
      for (int64_t j = 0; j < per; j++) ws[j] = weights(nb0 + std::min<int64_t>(j, count - 1));
      if (MB == 1) {
        _tile_zero(0); _tile_zero(1);
        for (int64_t t = 0; t < KT; t++) {
          _tile_loadd(6, xp + t * 512, 64);
          _tile_loadd(4, ws[0] + t * 32, stride);
          _tile_loadd(5, ws[1] + t * 32, stride);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 5, 6);
        }
        _tile_stored(0, out[0], 64); _tile_stored(1, out[1], 64);
        for (int64_t j = 0; j < count; j++)
          store_tile(out[j], bias, yp, N, (nb0 + j) * 16, 0, nb0 + j < NB ? 16 : tail, M);
        continue;
      }
      const int64_t next = nb0 + per;  // the next group's weight rows, prefetched while the first rows pass
      const int64_t ahead = g + 1 < g1 ? std::min<int64_t>(per * 16, (NB - next) * 16) : 0;
      for (int64_t mb = 0; mb < MB; mb += 2) {
        const at::BFloat16* x0 = xp + mb * (K / 2) * 32;
        const at::BFloat16* x1 = mb + 1 < MB ? x0 + (K / 2) * 32 : x0;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t t = 0; t < KT; t++) {
          if (mb == 0)
            for (int64_t r = 0; r < ahead; r++) _mm_prefetch((const char*)(wp + (next * 16 + r) * K + t * 32), _MM_HINT_T1);
          _tile_loadd(6, x0 + t * 512, 64);
          _tile_loadd(7, x1 + t * 512, 64);
          _tile_loadd(4, ws[0] + t * 32, stride);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_loadd(5, ws[1] + t * 32, stride);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, out[0], 64); _tile_stored(1, out[1], 64);  // tile numbers are immediates
        _tile_stored(2, out[2], 64); _tile_stored(3, out[3], 64);
        for (int64_t j = 0; j < count; j++) {
          const int64_t n0 = (nb0 + j) * 16, rows_n = nb0 + j < NB ? 16 : tail;
          store_tile(out[2 * j], bias, yp, N, n0, mb * 16, rows_n, std::min<int64_t>(16, M - mb * 16));
          if (mb + 1 < MB)
            store_tile(out[2 * j + 1], bias, yp, N, n0, (mb + 1) * 16, rows_n, std::min<int64_t>(16, M - (mb + 1) * 16));
        }
      }
    }
  });
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
#ifdef HAVE_AMX
  if (use_amx && K % 32 == 0) {  // by the weight's shape, never by the rows: one path for every call of a weight
    torch::Tensor padded;  // the weight rows past the last block of 16, zero-padded to 16
    if (N % 16) {
      padded = torch::zeros({16, K}, wc.options());
      padded.narrow(0, 0, N % 16).copy_(wc.narrow(0, N - N % 16, N % 16));
    }
    amx_linear(xp, wp, bp, yp, M, K, N, N % 16 ? padded.data_ptr<at::BFloat16>() : nullptr);
    return y;
  }
#endif
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
    return attention_cpu.build(
        "adaptive_spec_linear_bf16",
        SOURCE,
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
