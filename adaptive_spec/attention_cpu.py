"""A batch-invariant attention kernel in C++ for the CPU, built at run time, for the compiled step.

exact.attention gets its invariance from PyTorch operators arranged in a fixed order (fp32 products
in blocks of 128 keys), at the price of about 25 operators per layer: on the default model 4-7 ms of
a 22 ms compiled step went to them. This kernel computes the same thing in one call per layer, with
every reduction in an order fixed by the code alone, so a query's result cannot depend on what else
shares the call:

    for each (row, head, query):                     # parallel over these, each independent
        s[j] = scale * dot(q, k[j])  for the keys j the mask allows   (dot: 16 lanes over head_dim,
        m = max s; e[j] = exp(s[j] - m)                               then the lanes summed in order)
        out = (sum_j e[j] * v[j]) / (sum_j e[j])    j ascending, masked keys skipped

Skipping a masked key is the same as adding its exact zero, so keys past a row's own context (other
rows' longer contexts, the cache's spare capacity) change nothing; the arithmetic is bf16 or fp32
inputs with fp32 accumulation, as SDPA's. It is not bitwise the same as exact.attention (another
summation order), which is why a model uses one or the other for all its steps: the compiled step
uses this one when it builds, and exact.check measures the result like any other path.

    from adaptive_spec import attention_cpu
    kernel = attention_cpu.load(build_dir)   # None when no C++ compiler is at hand (then exact.attention)
    out = kernel(query, key, value, mask, scale)   # [n, heads, q, d] ... -> [n, q, heads, d]

Building takes about 30 s once per machine (cached in `build_dir`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from adaptive_spec.options import CoreSettings

log = logging.getLogger(__name__)

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

// One (row, kv head) per task: its keys and values converted to fp32 once, then every query of the
// heads that share them, each on its own: fixed-order reductions, masked keys skipped.
template <typename T>
static void attend(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                   const at::Tensor& mask, double scale, at::Tensor& out) {
  const int64_t n = query.size(0), heads = query.size(1), q = query.size(2), d = query.size(3);
  const int64_t kv_heads = key.size(1), kv_len = key.size(2), groups = heads / kv_heads;
  const T* Q = query.data_ptr<T>();
  const T* K = key.data_ptr<T>();
  const T* V = value.data_ptr<T>();
  const bool* M = mask.data_ptr<bool>();
  T* O = out.data_ptr<T>();
  const auto qs = query.strides(); const auto ks = key.strides(); const auto vs = value.strides();
  const auto ms = mask.strides(); const auto os = out.strides();
  constexpr int LANES = 16;
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kf(kv_len * d), vf(kv_len * d), scores(kv_len), acc(d), qf(d);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, g = task % kv_heads;
      for (int64_t j = 0; j < kv_len; ++j) {
        const T* kp = K + b * ks[0] + g * ks[1] + j * ks[2];
        const T* vp = V + b * vs[0] + g * vs[1] + j * vs[2];
        for (int64_t t = 0; t < d; ++t) {
          kf[j * d + t] = static_cast<float>(kp[t * ks[3]]);
          vf[j * d + t] = static_cast<float>(vp[t * vs[3]]);
        }
      }
      for (int64_t h = g * groups; h < (g + 1) * groups; ++h) {
        for (int64_t i = 0; i < q; ++i) {
          const T* qp = Q + b * qs[0] + h * qs[1] + i * qs[2];
          for (int64_t t = 0; t < d; ++t) qf[t] = static_cast<float>(qp[t * qs[3]]);
          const bool* mp = M + b * ms[0] + i * ms[2];
          float top = -std::numeric_limits<float>::infinity();
          for (int64_t j = 0; j < kv_len; ++j) {
            if (!mp[j * ms[3]]) continue;
            const float* kr = kf.data() + j * d;
            float lane[LANES] = {0};
            int64_t t = 0;
            for (; t + LANES <= d; t += LANES)
              for (int u = 0; u < LANES; ++u) lane[u] += qf[t + u] * kr[t + u];
            for (; t < d; ++t) lane[t % LANES] += qf[t] * kr[t];
            float s = 0.f;
            for (int u = 0; u < LANES; ++u) s += lane[u];
            s *= fscale;
            scores[j] = s;
            if (s > top) top = s;
          }
          float total = 0.f;
          for (int64_t t = 0; t < d; ++t) acc[t] = 0.f;
          for (int64_t j = 0; j < kv_len; ++j) {
            if (!mp[j * ms[3]]) continue;
            const float e = std::exp(scores[j] - top);
            total += e;
            const float* vr = vf.data() + j * d;
            for (int64_t t = 0; t < d; ++t) acc[t] += e * vr[t];
          }
          T* op = O + b * os[0] + i * os[1] + h * os[2];
          for (int64_t t = 0; t < d; ++t) op[t * os[3]] = static_cast<T>(acc[t] / total);
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
"""

_loaded: dict[str, object] = {}


def load(build_dir: Path | str | None = None):
    """The compiled kernel's `attention(query, key, value, mask, scale)`, or None where it cannot be
    built (no C++ compiler, or ADAPTIVE_SPEC_CPU_ATTENTION=0)."""
    if not CoreSettings.from_env().cpu_attention:
        return None
    key = "kernel"  # one build per process, wherever the first caller keeps it
    if key not in _loaded:
        try:
            from torch.utils.cpp_extension import load_inline

            directory = Path(build_dir) if build_dir is not None else None
            if directory is not None:
                directory.mkdir(parents=True, exist_ok=True)
            module = load_inline(
                name="adaptive_spec_attention_cpu",
                cpp_sources=SOURCE,
                functions=["attention"],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory) if directory is not None else None,
                verbose=False,
            )
            _loaded[key] = module.attention
        except Exception as exc:  # no compiler, no headers: the operator version serves
            log.warning("the C++ attention kernel could not be built (%s); using exact.attention", exc)
            _loaded[key] = None
    return _loaded[key]


def reference(query, key, value, mask, scale) -> torch.Tensor:
    """The kernel's formula in PyTorch (fp32), for tests."""
    groups = query.shape[1] // key.shape[1]
    keys = key.float().repeat_interleave(groups, dim=1)
    values = value.float().repeat_interleave(groups, dim=1)
    scores = (query.float() @ keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ values).transpose(1, 2).to(query.dtype)
