
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
