// CUDA kernels of value_loss (no torch headers: tests/test_aot.py compiles this file on its own,
// and tests/ops/test_value_loss.py runs it on the host through tests/cuda_host_emu.h).
// Pass 1: each block of kTile tokens computes the per-token loss and gradient (csrc/common/ppo_math.h,
// shared with the CPU kernel) and writes partials: loss, counts, sums and, for the explained variance,
// (sum, sum of squared deviations from the block mean) of the returns and of returns - values, in float64
// (returns ~1e30 square past float32). A trainable token whose float32 loss is not finite is done again in
// float64 (value_token_f64, as the CPU kernel does). Pass 2: one block merges the partials in a fixed
// order (Chan et al.), so results are bitwise deterministic.
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
  double eps64;    // the same in float64 (the float64 redo)
  float* grad;     // [T] or null
  double* part;    // [n_blocks, kParts]
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
  __shared__ double smem[kThreads];
  const bool use_clip = p.eps >= 0.f;
  const int64_t base = (int64_t)blockIdx.x * kTile;
  double loss = 0.0, sv = 0.0, sr = 0.0;  // float64: a redone token's loss, returns ~1e30 (their squares)
  float n = 0.f, nc = 0.f;
  float r_tok[kItems], v_tok[kItems];
  bool m_tok[kItems];
  unsigned redo = 0;  // bit i: item i is a trainable token whose float32 loss is not finite
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int64_t t = base + i * kThreads + threadIdx.x;
    m_tok[i] = t < p.T && p.mask[t];
    r_tok[i] = v_tok[i] = 0.f;
    if (t >= p.T) continue;
    const float v = p.v[t], r = p.ret[t];
    const ValueToken o = value_token(v, use_clip ? p.old[t] : v, r, use_clip ? p.eps : 0.f, use_clip);
    const float w = (float)token_weight<idx_t>(p, t);
    const bool m = m_tok[i], bad = m & !is_finite(o.loss), ok = m & !bad;
    redo |= (unsigned)bad << i;
    if (p.grad != nullptr) p.grad[t] = m ? weight_scale(o.dv, w) : 0.f;  // a redone token's is written again
    loss += ok ? weight_scale(o.loss, w) : 0.f;
    n += m;
    nc += ok ? o.clipped : 0.f;
    sv += m ? (double)v : 0.0;
    sr += m ? (double)r : 0.0;
    r_tok[i] = r;
    v_tok[i] = v;
  }
  // the tokens to redo in float64, after the loop (as in ppo_loss_kernels.cuh)
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    if (!(redo >> i & 1u)) continue;
    const int64_t t = base + i * kThreads + threadIdx.x;
    const ValueToken64 d = value_token_f64(v_tok[i], use_clip ? p.old[t] : v_tok[i], r_tok[i],
                                           use_clip ? p.eps64 : -1.0, token_weight<idx_t>(p, t));
    if (p.grad != nullptr) p.grad[t] = (float)d.grad;
    loss += d.lw;
    nc += d.clipped;
  }
  loss = block_sum(loss, smem);
  const double nb = block_sum<double>(n, smem);
  const double ncb = block_sum<double>(nc, smem);
  sv = block_sum(sv, smem);
  sr = block_sum(sr, smem);
  const double mean_r = sr / (nb > 1.0 ? nb : 1.0), mean_e = (sr - sv) / (nb > 1.0 ? nb : 1.0);
  double m2r = 0.0, m2e = 0.0;
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const double r = r_tok[i], dr = r - mean_r, de = (r - v_tok[i]) - mean_e;
    m2r += m_tok[i] ? dr * dr : 0.0;
    m2e += m_tok[i] ? de * de : 0.0;
  }
  m2r = block_sum(m2r, smem);
  m2e = block_sum(m2e, smem);
  if (threadIdx.x == 0) {
    double* out = p.part + (int64_t)blockIdx.x * kParts;
    out[0] = loss;
    out[1] = nb;
    out[2] = ncb;
    out[3] = sv;
    out[4] = sr;
    out[5] = m2r;
    out[6] = sr - sv;
    out[7] = m2e;
  }
}

// One block: thread i merges partial rows i, i + kThreads, ... in order, then a fixed pairwise tree.
__global__ void __launch_bounds__(kThreads) value_loss_reduce_kernel(const double* part, int64_t n_blocks,
                                                                     float* loss, float* metrics) {
  __shared__ double sd[kThreads];
  __shared__ Moments sm_r[kThreads], sm_e[kThreads];
  double l = 0.0, nc = 0.0, sv = 0.0;
  Moments mr{0, 0, 0}, me{0, 0, 0};
  for (int64_t b = threadIdx.x; b < n_blocks; b += kThreads) {
    const double* q = part + b * kParts;
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
// `part` needs n_blocks(T) * kParts doubles.
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
