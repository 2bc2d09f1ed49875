
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

// 16 floats, one IEEE operation per element: GCC's and Clang's vector extensions, lowered to
// whatever SIMD the machine has (or to scalar code).
typedef float f16v __attribute__((vector_size(64), aligned(4)));
constexpr int KEYS = 16;             // keys scored together, one per element of an f16v
constexpr int LANES = 8;             // partial sums of a dot product: dimension t goes to lane t % 8
constexpr int64_t QUERY_BLOCK = 16;  // queries per task, so that one long prompt spreads over threads
constexpr int HEAD_BLOCK = 4;        // heads of a kv group whose weighted values are summed together
constexpr int64_t AHEAD = 16;        // keys (and values) prefetched ahead of their conversion

static inline f16v load(const float* p) { f16v v; std::memcpy(&v, p, sizeof v); return v; }
static inline void store(float* p, f16v v) { std::memcpy(p, &v, sizeof v); }
// 16 bf16 values widened to fp32 (exact: a bf16 is the top half of its fp32).
typedef uint16_t u16v __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32v __attribute__((vector_size(64)));
static inline f16v load(const at::BFloat16* p) {
  u16v h;
  std::memcpy(&h, p, sizeof h);
  const u32v wide = __builtin_convertvector(h, u32v) << 16;
  f16v v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}

// Sixteen keys converted at once: 16 rows of 16 values each (keys x dimensions) transposed in
// registers, by four rounds of exchanging off-diagonal blocks (8x8, 4x4, 2x2, 1x1) between row
// pairs. Moving values changes none of them; it replaces a scattered store per value. GCC's
// __builtin_shuffle; other compilers convert one key at a time, as before (the same numbers).
#if defined(__GNUC__) && !defined(__clang__)
constexpr bool BLOCKS = true;
typedef int32_t i16v __attribute__((vector_size(64)));
static const i16v LOW[4] = {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                            {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
                            {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
                            {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}};
static const i16v HIGH[4] = {{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
                             {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
                             {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
                             {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}};

static inline void transpose16(f16v* r) {
#pragma GCC unroll 4
  for (int round = 0, span = 8; round < 4; ++round, span /= 2)
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i)
      if (!(i & span)) {
        const f16v low = __builtin_shuffle(r[i], r[i + span], LOW[round]);
        const f16v high = __builtin_shuffle(r[i], r[i + span], HIGH[round]);
        r[i] = low;
        r[i + span] = high;
      }
}

// Keys k0, k0 + stride, ... (16 of them, d contiguous bf16 values each, d a multiple of 16) into one
// block of the transposed layout: kb[t * KEYS + u] = key u's dimension t, in fp32.
static void convert_block(const at::BFloat16* k0, int64_t stride, int64_t d, float* kb) {
  for (int64_t t0 = 0; t0 < d; t0 += 16) {
    f16v r[KEYS];
    for (int u = 0; u < KEYS; ++u) r[u] = load(k0 + u * stride + t0);
    transpose16(r);
    for (int c = 0; c < 16; ++c) store(kb + (t0 + c) * KEYS, r[c]);
  }
}
#else
constexpr bool BLOCKS = false;
static void convert_block(const at::BFloat16*, int64_t, int64_t, float*) {}
#endif

// exp(x) for x <= 0 from exactly rounded operations only (Cephes' expf polynomial), so vector and
// scalar code give the same bits; within about 1 ulp of std::exp.
static inline float exp_fixed(float x) {
  x = x > -87.0f ? (x < 0.0f ? x : 0.0f) : -87.0f;  // a key out of sight may hold anything, NaN included
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = std::fma(n, -0.693359375f, x);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p, r * r, r);
  p = p + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

// Scores of the keys in blocks [first, last) for one query's H heads of a kv group: w[h][j] = scale *
// dot(q[h], k_j), the dot product in 8 lanes (dimension t into lane t % 8), the lanes then summed in order.
// A block of keys is read once for all the heads (it was read once per head: the same sums, in the same order).
template <int H>
static void score_heads(const float* const* qf, const float* kt, int64_t d, int64_t first, int64_t last, float scale,
                        float* const* w) {
  for (int64_t blk = first; blk < last; ++blk) {
    const float* kb = kt + blk * d * KEYS;
    f16v lane[H][LANES] = {};
    int64_t t = 0;
    for (; t + LANES <= d; t += LANES)
#pragma GCC unroll 8
      for (int u = 0; u < LANES; ++u) {
        const f16v k = load(kb + (t + u) * KEYS);
        for (int h = 0; h < H; ++h) lane[h][u] = lane[h][u] + qf[h][t + u] * k;
      }
    for (; t < d; ++t) {
      const f16v k = load(kb + t * KEYS);
      for (int h = 0; h < H; ++h) lane[h][t % LANES] = lane[h][t % LANES] + qf[h][t] * k;
    }
    for (int h = 0; h < H; ++h) {
      f16v s = lane[h][0];
      for (int u = 1; u < LANES; ++u) s = s + lane[h][u];
      store(w[h] + blk * KEYS, s * scale);
    }
  }
}

// acc[h][:] = sum over the kept keys j, ascending, of w[h][j] * v_j, for `heads` heads at once
// (DV = d / 16 vectors a head); total[h] = sum of w[h][j] in the same order. v_j starts at
// vf + j * stride, in fp32 or bf16 (widened exactly as it is read).
template <int DV, int H, typename VT>
static void weigh(const float* const* w, const VT* vf, int64_t stride, const int64_t* keep, int64_t kept, float* acc,
                  float* total) {
  f16v a[H][DV] = {};
  float sum[H] = {};
  for (int64_t m = 0; m < kept; ++m) {
    const int64_t j = keep[m];
    f16v v[DV];
    for (int c = 0; c < DV; ++c) v[c] = load(vf + j * stride + c * 16);
    for (int h = 0; h < H; ++h) {
      const float e = w[h][j];
      sum[h] = sum[h] + e;
      for (int c = 0; c < DV; ++c) a[h][c] = a[h][c] + e * v[c];
    }
  }
  for (int h = 0; h < H; ++h) {
    total[h] = sum[h];
    for (int c = 0; c < DV; ++c) store(acc + h * DV * 16 + c * 16, a[h][c]);
  }
}

// The same sums for any head size, one element at a time.
static void weigh_any(const float* const* w, const float* vf, int64_t d, const int64_t* keep, int64_t kept,
                      int heads, float* acc, float* total) {
  for (int h = 0; h < heads; ++h) {
    float* ah = acc + h * d;
    std::fill(ah, ah + d, 0.f);
    float sum = 0.f;
    for (int64_t m = 0; m < kept; ++m) {
      const float e = w[h][keep[m]];
      sum = sum + e;
      const float* vr = vf + keep[m] * d;
      for (int64_t t = 0; t < d; ++t) ah[t] = ah[t] + e * vr[t];
    }
    total[h] = sum;
  }
}

template <int DV, typename VT>
static void weigh_heads(const float* const* w, const VT* vf, int64_t stride, const int64_t* keep, int64_t kept,
                        int heads, float* acc, float* total) {
  switch (heads) {
    case 1: weigh<DV, 1>(w, vf, stride, keep, kept, acc, total); break;
    case 2: weigh<DV, 2>(w, vf, stride, keep, kept, acc, total); break;
    case 3: weigh<DV, 3>(w, vf, stride, keep, kept, acc, total); break;
    default: weigh<DV, 4>(w, vf, stride, keep, kept, acc, total); break;
  }
}

template <typename T>
static void attend(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                   const at::Tensor& mask, double scale, at::Tensor& out) {
  const int64_t n = query.size(0), heads = query.size(1), q = query.size(2), d = query.size(3);
  const int64_t kv_heads = key.size(1), kv_len = key.size(2), groups = heads / kv_heads;
  // A step's few queries (a verify, a tree's nodes) take a task each where blocks of 16 would leave a thread
  // idle: 1 row x 9 queries over 3 kv heads made 3 tasks for 2 threads, one thread doing two thirds
  const int64_t coarse = n * kv_heads * ((q + QUERY_BLOCK - 1) / QUERY_BLOCK);
  const int64_t qblock = coarse >= 4 * at::get_num_threads() ? QUERY_BLOCK : 1;
  const int64_t qblocks = (q + qblock - 1) / qblock;
  const T* Q = query.data_ptr<T>();
  const T* K = key.data_ptr<T>();
  const T* V = value.data_ptr<T>();
  const bool* M = mask.data_ptr<bool>();
  T* O = out.data_ptr<T>();
  const auto qs = query.strides(); const auto ks = key.strides(); const auto vs = value.strides();
  const auto ms = mask.strides(); const auto os = out.strides();
  const float fscale = static_cast<float>(scale);
  // bf16 values with contiguous rows are read where they lie, widened as they are used; others are
  // first copied out in fp32 (the same numbers either way)
  const bool direct = std::is_same<T, at::BFloat16>::value && vs[3] == 1 && (d == 64 || d == 128);
  at::parallel_for(0, n * kv_heads * qblocks, 1, [&](int64_t begin, int64_t end) {
    // keys as [block][dimension][16 keys] (padding keys 0), values as [key][dimension] (unless read
    // in place), in fp32
    std::vector<float> kt, vf(direct ? 0 : kv_len * d), qf(HEAD_BLOCK * d);
    std::vector<float> weights, acc(HEAD_BLOCK * d);
    std::vector<int64_t> keep(kv_len);
    int64_t converted = -1, ready = 0;  // kt and vf hold keys 0..ready-1 of the (row, kv head) `converted`
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bg = task / qblocks, qb = task % qblocks;
      const int64_t b = bg / kv_heads, g = bg % kv_heads;
      if (bg != converted) {
        converted = bg;
        ready = 0;
      }
      for (int64_t i = qb * qblock; i < std::min(q, (qb + 1) * qblock); ++i) {
        const bool* mp = M + b * ms[0] + i * ms[2];
        // the keys past the last one it may see, skipped 8 at a time: after a long prompt the cache's
        // capacity stays long, and a short row's query scanned all of it
        int64_t reach = kv_len;
        if (ms[3] == 1)
          for (uint64_t word; reach >= 8 && (std::memcpy(&word, mp + reach - 8, 8), word == 0);) reach -= 8;
        int64_t kept = 0;  // the keys this query sees, ascending
        for (int64_t j = 0; j < reach; ++j) {
          keep[kept] = j;
          kept += mp[j * ms[3]] ? 1 : 0;
        }
        const int64_t first = kept ? keep[0] / KEYS : 0, last = kept ? keep[kept - 1] / KEYS + 1 : 0;
        // the scratch grows with the keys reached, not the capacity (it was zeroed whole at every call)
        if (static_cast<int64_t>(kt.size()) < last * d * KEYS) kt.resize(last * d * KEYS, 0.f);
        if (static_cast<int64_t>(weights.size()) < HEAD_BLOCK * last * KEYS) weights.resize(HEAD_BLOCK * last * KEYS);
        const int64_t stride = static_cast<int64_t>(weights.size()) / HEAD_BLOCK;  // a head's span of `weights`
        // Convert the keys this query's blocks reach, once per (row, kv head): a cache's spare
        // capacity past every query's context is never read (it was 2/3 of a batched step's work).
        for (const int64_t need = std::min(last * KEYS, kv_len); ready < need; ++ready) {
          const int64_t j = ready;
          const T* kp = K + b * ks[0] + g * ks[1] + j * ks[2];
          const T* vp = V + b * vs[0] + g * vs[1] + j * vs[2];
          if constexpr (std::is_same<T, at::BFloat16>::value) {
            if (BLOCKS && direct && ks[3] == 1 && d % 16 == 0 && j % KEYS == 0 && j + KEYS <= need) {  // a whole block
              if (j + 2 * KEYS <= need)  // the next block's keys and values, fetched ahead of use
                for (int64_t u = KEYS; u < 2 * KEYS; ++u)
                  for (int64_t t = 0; t < d * static_cast<int64_t>(sizeof(T)); t += 64) {
                    __builtin_prefetch(reinterpret_cast<const char*>(kp + u * ks[2]) + t);
                    __builtin_prefetch(reinterpret_cast<const char*>(vp + u * vs[2]) + t);
                  }
              convert_block(kp, ks[2], d, kt.data() + (j / KEYS) * d * KEYS);
              ready += KEYS - 1;
              continue;
            }
          }
          if (j + AHEAD < need) {  // the cache is read from memory once a step: fetch ahead of use
            for (int64_t t = 0; t < d * static_cast<int64_t>(sizeof(T)); t += 64) {
              __builtin_prefetch(reinterpret_cast<const char*>(kp + AHEAD * ks[2]) + t);
              __builtin_prefetch(reinterpret_cast<const char*>(vp + AHEAD * vs[2]) + t);
            }
          }
          float* kd = kt.data() + (j / KEYS) * d * KEYS + (j % KEYS);
          for (int64_t t = 0; t < d; ++t) kd[t * KEYS] = static_cast<float>(kp[t * ks[3]]);
          if (!direct)
            for (int64_t t = 0; t < d; ++t) vf[j * d + t] = static_cast<float>(vp[t * vs[3]]);
        }
        for (int64_t h0 = g * groups; h0 < (g + 1) * groups; h0 += HEAD_BLOCK) {
          const int hn = static_cast<int>(std::min<int64_t>(HEAD_BLOCK, (g + 1) * groups - h0));
          const float* qh[HEAD_BLOCK];
          float* w[HEAD_BLOCK];  // each head's scores, then its weights
          for (int h = 0; h < hn; ++h) {
            const T* qp = Q + b * qs[0] + (h0 + h) * qs[1] + i * qs[2];
            for (int64_t t = 0; t < d; ++t) qf[h * d + t] = static_cast<float>(qp[t * qs[3]]);
            qh[h] = qf.data() + h * d;
            w[h] = weights.data() + h * stride;
          }
          switch (hn) {
            case 1: score_heads<1>(qh, kt.data(), d, first, last, fscale, w); break;
            case 2: score_heads<2>(qh, kt.data(), d, first, last, fscale, w); break;
            case 3: score_heads<3>(qh, kt.data(), d, first, last, fscale, w); break;
            default: score_heads<4>(qh, kt.data(), d, first, last, fscale, w); break;
          }
          for (int h = 0; h < hn; ++h) {
            float* wh = w[h];
            // the largest kept score, over 8 running maxima (one chain of dependent maxima was an eighth
            // of a batched step's attention); std::max(a, b) keeps a when b is NaN, so any grouping gives
            // the same top, and a top of +0 or -0 gives the same differences below
            float tops[8];
            std::fill(tops, tops + 8, -std::numeric_limits<float>::infinity());
            int64_t m = 0;
            for (; m + 8 <= kept; m += 8)
              for (int u = 0; u < 8; ++u) tops[u] = std::max(tops[u], wh[keep[m + u]]);
            for (; m < kept; ++m) tops[0] = std::max(tops[0], wh[keep[m]]);
            float top = tops[0];
            for (int u = 1; u < 8; ++u) top = std::max(top, tops[u]);
            for (int64_t j = first * KEYS; j < last * KEYS; ++j) wh[j] = exp_fixed(wh[j] - top);
          }
          float total[HEAD_BLOCK];
          const T* vrow = V + b * vs[0] + g * vs[1];  // the values read in place (`direct`)
          if (d == 64 && direct) weigh_heads<4>(w, vrow, vs[2], keep.data(), kept, hn, acc.data(), total);
          else if (d == 128 && direct) weigh_heads<8>(w, vrow, vs[2], keep.data(), kept, hn, acc.data(), total);
          else if (d == 64) weigh_heads<4>(w, vf.data(), d, keep.data(), kept, hn, acc.data(), total);
          else if (d == 128) weigh_heads<8>(w, vf.data(), d, keep.data(), kept, hn, acc.data(), total);
          else weigh_any(w, vf.data(), d, keep.data(), kept, hn, acc.data(), total);
          for (int h = 0; h < hn; ++h) {
            T* op = O + b * os[0] + i * os[1] + (h0 + h) * os[2];
            for (int64_t t = 0; t < d; ++t) op[t * os[3]] = static_cast<T>(acc[h * d + t] / total[h]);
          }
        }
      }
    }
  });
}

at::Tensor attention(at::Tensor query, at::Tensor key, at::Tensor value, at::Tensor mask, double scale) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4 && mask.dim() == 4, "4-d inputs");
  TORCH_CHECK(mask.scalar_type() == at::kBool, "a boolean mask");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(), "one dtype");
  auto out = at::empty({query.size(0), query.size(2), query.size(1), query.size(3)}, query.options());
  if (query.scalar_type() == at::kBFloat16) attend<at::BFloat16>(query, key, value, mask, scale, out);
  else if (query.scalar_type() == at::kFloat) attend<float>(query, key, value, mask, scale, out);
  else TORCH_CHECK(false, "bf16 or fp32 only");
  return out;
}

// Also an operator of the dispatcher, so that a compiled step calls it with no Python in between (as
// a Python custom operator around the pybind function it cost 5-14 us more a call, 30 calls a step).
TORCH_LIBRARY(adaptive_spec_attention, m) {
  m.def("attention(Tensor query, Tensor key, Tensor value, Tensor mask, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(adaptive_spec_attention, CPU, m) { m.impl("attention", &attention); }
