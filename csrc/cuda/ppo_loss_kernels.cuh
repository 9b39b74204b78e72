// CUDA kernels of ppo_policy_loss (no torch headers: tests/test_aot.py compiles this file on its own,
// and tests/ops/test_ppo_loss.py runs it on the host through tests/cuda_host_emu.h).
// Pass 1: each block of kTile tokens computes the per-token loss and gradient (csrc/common/ppo_math.h,
// the same code the CPU kernel runs) and writes its partial sums to part[block]. A trainable token whose
// float32 loss or KL term is not finite is done again in float64 (ppo_token_f64, as the CPU kernel does),
// so the loss and KL partials are float64. Pass 2: one block adds the partials in a fixed order. No float
// atomics, so results are bitwise deterministic.
// The torch binding is csrc/cuda/ppo_loss.cu; semantics: compactionrl_fast/ops/ppo_loss.py.
#pragma once
#include "kernel_common.cuh"

#include <cmath>

#include "../common/ppo_math.h"

namespace crf {
namespace ppo_cuda {

constexpr int kThreads = CRF_LOSS_THREADS;  // a power of two
constexpr int kItems = CRF_LOSS_ITEMS;                     // tokens per thread
constexpr int kTile = kThreads * kItems;      // tokens per block
constexpr int kParts = 8;                     // loss, tokens, clipped, dual, kl, ratio_max, log ratio, 1 unused

struct Params {
  const float *logp, *old, *adv, *roll;  // [T]; roll may be null
  const bool* mask;                      // [T]
  const void* cu;                        // [S+1] int32/int64, or null (one segment)
  const double* scale;                   // [S] reduction weight of each segment's tokens
  int64_t S, T;
  float ratio_lo, ratio_hi, dual_c, tis_cap;
  double lo64, hi64, dual64, cap64;  // the same in float64 (the float64 redo); dual64 = 0: no dual clip
  float* grad;     // [T] or null
  double* part;    // [n_blocks, kParts]
  float* loss;     // []
  float* metrics;  // [5]
};

// Fixed-order block reductions through shared memory (a tree over the thread index).
template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, T* smem, Op op) {
  smem[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) smem[threadIdx.x] = op(smem[threadIdx.x], smem[threadIdx.x + s]);
    __syncthreads();
  }
  const T out = smem[0];
  __syncthreads();
  return out;
}

struct Add {
  template <typename T>
  __device__ T operator()(T a, T b) const { return a + b; }
};
struct Max {  // keeps a NaN of either side (a NaN log-prob must show in ratio_max)
  template <typename T>
  __device__ T operator()(T a, T b) const { return (a > b) | (a != a) ? a : b; }
};

template <typename idx_t, bool TIS>
__global__ void __launch_bounds__(kThreads) ppo_loss_block_kernel(Params p) {
  __shared__ double smem[kThreads];
  double loss = 0.0, kl = 0.0;  // a redone token's terms may be past float32's range
  float n = 0.f, nc = 0.f, nd = 0.f, lr = 0.f, rmax = 0.f;
  unsigned redo = 0;  // bit i: item i is a trainable token with a float32 loss or KL term that is not finite
  const int64_t base = (int64_t)blockIdx.x * kTile;
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int64_t t = base + i * kThreads + threadIdx.x;  // coalesced
    if (t >= p.T) break;
    const bool m = p.mask[t];
    const float x = p.logp[t] - p.old[t];
    const PpoToken o = ppo_token(x, p.adv[t], p.ratio_lo, p.ratio_hi, p.dual_c);
    float l = o.loss, g = o.dlogp;
    if (TIS) {
      const float d = p.old[t] - p.roll[t], wi = exp_f32(d);
      const float wc = wi > p.tis_cap ? p.tis_cap : wi;  // a NaN weight stays NaN
      l = tis_scale(l, wc, d);
      g = o.clipped + o.dual != 0.f ? g : tis_scale(g, wc, d);  // a clipped token's 0 (or NaN) stays
    }
    g = l != l ? l : g;  // a NaN loss term gives a NaN gradient (docs/ops.md, "Non-finite input")
    const float w = (float)token_weight<idx_t>(p, t), k = kl_term(x, o.ratio);
    const bool bad = m & !(is_finite(l) & is_finite(k)), ok = m & !bad;
    redo |= (unsigned)bad << i;
    if (p.grad != nullptr) p.grad[t] = m ? weight_scale(g, w) : 0.f;  // a redone token's is written again
    loss += ok ? weight_scale(l, w) : 0.f;
    n += m;
    nc += ok ? o.clipped : 0.f;
    nd += ok ? o.dual : 0.f;
    kl += ok ? k : 0.f;
    lr += m ? x : 0.f;
    rmax = ok ? nan_max(o.ratio, rmax) : rmax;
  }
  // the tokens to redo in float64, after the loop: inside it the float64 code took ~80 registers (sm_90, TIS)
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    if (!(redo >> i & 1u)) continue;
    const int64_t t = base + i * kThreads + threadIdx.x;
    const double old = p.old[t];
    const PpoToken64 d = ppo_token_f64<TIS>((double)p.logp[t] - old, p.adv[t], TIS ? old - (double)p.roll[t] : 0.0,
                                            token_weight<idx_t>(p, t), p.lo64, p.hi64, p.dual64, p.cap64);
    if (p.grad != nullptr) p.grad[t] = (float)d.grad;
    loss += d.lw;
    nc += d.clipped;
    nd += d.dual;
    kl += d.kl;
    rmax = nan_max((float)d.ratio, rmax);
  }
  double* out = p.part + (int64_t)blockIdx.x * kParts;
  const double vals[7] = {loss, n, nc, nd, kl, rmax, lr};
#pragma unroll
  for (int k = 0; k < 7; ++k) {
    const double s = k == 5 ? block_reduce(vals[k], smem, Max()) : block_reduce(vals[k], smem, Add());
    if (threadIdx.x == 0) out[k] = s;
  }
}

// One block: thread i adds partial rows i, i + kThreads, ... in order (double), then a fixed tree.
__global__ void __launch_bounds__(kThreads) ppo_loss_reduce_kernel(const double* part, int64_t n_blocks, float* loss,
                                                                   float* metrics) {
  __shared__ double smem[kThreads];
  double acc[7] = {0, 0, 0, 0, 0, 0, 0};
  for (int64_t b = threadIdx.x; b < n_blocks; b += kThreads) {
#pragma unroll
    for (int k = 0; k < 5; ++k) acc[k] += part[b * kParts + k];
    acc[5] = Max()(acc[5], part[b * kParts + 5]);
    acc[6] += part[b * kParts + 6];
  }
  double tot[7];
#pragma unroll
  for (int k = 0; k < 5; ++k) tot[k] = block_reduce(acc[k], smem, Add());
  tot[5] = block_reduce(acc[5], smem, Max());
  tot[6] = block_reduce(acc[6], smem, Add());
  if (threadIdx.x == 0) {
    const double inv = tot[1] > 0 ? 1.0 / tot[1] : 0.0;
    *loss = (float)tot[0];
    metrics[0] = (float)(tot[2] * inv);  // clip_fraction
    metrics[1] = (float)(tot[3] * inv);  // dual_clip_fraction
    metrics[2] = (float)(tot[4] * inv);  // approx_kl
    metrics[3] = (float)tot[5];          // ratio_max
    metrics[4] = (float)(tot[6] * inv);  // log_ratio
  }
}

inline int64_t n_blocks(int64_t T) { return (T + kTile - 1) / kTile; }

// Host launcher (non-template: it instantiates every kernel, so this file compiles to a full cubin).
// `part` needs n_blocks(T) * kParts doubles.
void launch(const Params& p, bool cu_is_int64, cudaStream_t stream) {
  const int64_t nb = n_blocks(p.T);
  if (nb > 0) {
    const bool tis = p.roll != nullptr;
    auto k = cu_is_int64 ? (tis ? ppo_loss_block_kernel<int64_t, true> : ppo_loss_block_kernel<int64_t, false>)
                         : (tis ? ppo_loss_block_kernel<int32_t, true> : ppo_loss_block_kernel<int32_t, false>);
    CRF_LAUNCH(k, (unsigned)nb, kThreads, stream, p);
  }
  CRF_LAUNCH(ppo_loss_reduce_kernel, 1u, kThreads, stream, p.part, nb, p.loss, p.metrics);
}

}  // namespace ppo_cuda
}  // namespace crf
