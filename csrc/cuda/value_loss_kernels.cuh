// CUDA kernels of value_loss (no torch headers: tests/test_aot.py compiles this file on its own,
// and tests/ops/test_value_loss.py runs it on the host through tests/cuda_host_emu.h).
// Pass 1: each block of kTile tokens computes the per-token loss and gradient (csrc/common/ppo_math.h,
// shared with the CPU kernel) and writes partials: loss, counts, sums and, for the explained variance,
// (sum, sum of squared deviations from the block mean) of the returns and of returns - values. Pass 2:
// one block merges the partials in a fixed order (Chan et al.), so results are bitwise deterministic.
// The torch binding is csrc/cuda/value_loss.cu; semantics: compactionrl_fast/ops/value_loss.py.
#pragma once
#include "kernel_common.cuh"

#include <cmath>

#include "../common/ppo_math.h"

namespace crf {
namespace value_cuda {

constexpr int kThreads = CRF_LOSS_THREADS;  // a power of two
constexpr int kItems = CRF_LOSS_ITEMS;
constexpr int kTile = kThreads * kItems;
constexpr int kParts = 8;  // loss, tokens, clipped, sum_v, sum_r, m2_r, sum_e, m2_e  (e = returns - values)

struct Params {
  const float *v, *old, *ret;  // [T]
  const bool* mask;            // [T]
  const void* cu;              // [S+1] int32/int64, or null (one segment)
  const double* scale;         // [S]
  int64_t S, T;
  float eps;       // clip range; < 0: no clip
  float* grad;     // [T] or null
  float* part;     // [n_blocks, kParts]
  float* loss;     // []
  float* metrics;  // [3]
};

template <typename T>
__device__ __forceinline__ T block_sum(T v, T* smem) {
  smem[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) smem[threadIdx.x] += smem[threadIdx.x + s];
    __syncthreads();
  }
  const T out = smem[0];
  __syncthreads();
  return out;
}

// (count, sum, sum of squared deviations) of a set of numbers; merge() is Chan et al.'s update.
struct Moments {
  double n, sum, m2;
  __device__ void merge(const Moments& o) {
    if (o.n <= 0.0) return;
    if (n > 0.0) {
      const double d = o.sum / o.n - sum / n;
      m2 += o.m2 + d * d * n * o.n / (n + o.n);
    } else {
      m2 = o.m2;
    }
    n += o.n;
    sum += o.sum;
  }
};

template <typename idx_t>
__global__ void __launch_bounds__(kThreads) value_loss_block_kernel(Params p) {
  __shared__ float smem[kThreads];
  const idx_t* cu = static_cast<const idx_t*>(p.cu);
  const bool use_clip = p.eps >= 0.f;
  const int64_t base = (int64_t)blockIdx.x * kTile;
  float loss = 0.f, n = 0.f, nc = 0.f, sv = 0.f, sr = 0.f;
  float r_tok[kItems], e_tok[kItems];
  bool m_tok[kItems];
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int64_t t = base + i * kThreads + threadIdx.x;
    m_tok[i] = t < p.T && p.mask[t];
    r_tok[i] = e_tok[i] = 0.f;
    if (t >= p.T) continue;
    const float v = p.v[t], r = p.ret[t];
    const ValueToken o = value_token(v, use_clip ? p.old[t] : v, r, use_clip ? p.eps : 0.f, use_clip);
    // bad offsets (unchecked on CUDA) only steer the binary search: the index stays in [0, S)
    const float w = (float)(cu == nullptr ? p.scale[0] : p.scale[upper_index(cu, p.S, t)]);
    const bool m = m_tok[i];
    if (p.grad != nullptr) p.grad[t] = m ? weight_scale(o.dv, w) : 0.f;
    loss += m ? weight_scale(o.loss, w) : 0.f;
    n += m;
    nc += m ? o.clipped : 0.f;
    sv += m ? v : 0.f;
    sr += m ? r : 0.f;
    r_tok[i] = r;
    e_tok[i] = r - v;
  }
  loss = block_sum(loss, smem);
  n = block_sum(n, smem);
  nc = block_sum(nc, smem);
  sv = block_sum(sv, smem);
  sr = block_sum(sr, smem);
  const float mean_r = sr / (n > 1.f ? n : 1.f), mean_e = (sr - sv) / (n > 1.f ? n : 1.f);
  float m2r = 0.f, m2e = 0.f;
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const float dr = r_tok[i] - mean_r, de = e_tok[i] - mean_e;
    m2r += m_tok[i] ? dr * dr : 0.f;
    m2e += m_tok[i] ? de * de : 0.f;
  }
  m2r = block_sum(m2r, smem);
  m2e = block_sum(m2e, smem);
  if (threadIdx.x == 0) {
    float* out = p.part + (int64_t)blockIdx.x * kParts;
    out[0] = loss;
    out[1] = n;
    out[2] = nc;
    out[3] = sv;
    out[4] = sr;
    out[5] = m2r;
    out[6] = sr - sv;
    out[7] = m2e;
  }
}

// One block: thread i merges partial rows i, i + kThreads, ... in order, then a fixed pairwise tree.
__global__ void __launch_bounds__(kThreads) value_loss_reduce_kernel(const float* part, int64_t n_blocks,
                                                                     float* loss, float* metrics) {
  __shared__ double sd[kThreads];
  __shared__ Moments sm_r[kThreads], sm_e[kThreads];
  double l = 0.0, nc = 0.0, sv = 0.0;
  Moments mr{0, 0, 0}, me{0, 0, 0};
  for (int64_t b = threadIdx.x; b < n_blocks; b += kThreads) {
    const float* q = part + b * kParts;
    l += q[0];
    nc += q[2];
    sv += q[3];
    mr.merge(Moments{q[1], q[4], q[5]});
    me.merge(Moments{q[1], q[6], q[7]});
  }
  l = block_sum(l, sd);
  nc = block_sum(nc, sd);
  sv = block_sum(sv, sd);
  sm_r[threadIdx.x] = mr;
  sm_e[threadIdx.x] = me;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      sm_r[threadIdx.x].merge(sm_r[threadIdx.x + s]);
      sm_e[threadIdx.x].merge(sm_e[threadIdx.x + s]);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const double n = sm_r[0].n, inv = n > 0 ? 1.0 / n : 0.0;
    const double var_r = sm_r[0].m2 * inv, var_e = sm_e[0].m2 * inv;
    *loss = (float)l;
    metrics[0] = (float)(nc * inv);                               // clip_fraction
    metrics[1] = (float)(sv * inv);                               // value_mean
    metrics[2] = (float)(var_r <= 0.0 ? 0.0 : 1.0 - var_e / var_r);  // explained_variance (NaN stays NaN)
  }
}

inline int64_t n_blocks(int64_t T) { return (T + kTile - 1) / kTile; }

// Host launcher (non-template: it instantiates every kernel, so this file compiles to a full cubin).
// `part` needs n_blocks(T) * kParts floats.
void launch(const Params& p, bool cu_is_int64, cudaStream_t stream) {
  const int64_t nb = n_blocks(p.T);
  if (nb > 0) {
    auto k = cu_is_int64 ? value_loss_block_kernel<int64_t> : value_loss_block_kernel<int32_t>;
    CRF_LAUNCH(k, (unsigned)nb, kThreads, stream, p);
  }
  CRF_LAUNCH(value_loss_reduce_kernel, 1u, kThreads, stream, p.part, nb, p.loss, p.metrics);
}

}  // namespace value_cuda
}  // namespace crf
