// CUDA kernels of place_final_rewards (no torch headers: tests/test_aot.py compiles this file on its own, and
// tests/ops/test_place.py runs it on the host through tests/cuda_host_emu.h).
//   1. zero_kernel: every output token 0 (grid-stride);
//   2. place_kernel: one block per rollout walks its segments from the last; the block finds a segment's
//      last trainable token by scanning windows of kWindow mask bytes from the segment's end (a max
//      reduction in shared memory), and thread 0 stores the rollout's reward there; "stitched" stops at the
//      first segment that has one.
// Offsets are read clamped (cu_segments to [0, S], cu_seqlens to [0, T], each end at least its start): bad
// offsets, unchecked on CUDA, give wrong rewards, never an out-of-bounds access. Threads exchange data only
// through shared memory and __syncthreads, so the host emulation runs the same code.
// The torch binding is csrc/cuda/place.cu; semantics: compactionrl_fast/ops/gae.py.
#pragma once
#include "kernel_common.cuh"

namespace crf {
namespace place_cuda {

// Block shape; the host-emulation tests also build it small so that segments span several windows.
#ifndef CRF_PLACE_THREADS
#define CRF_PLACE_THREADS 128
#endif
#ifndef CRF_PLACE_ITEMS
#define CRF_PLACE_ITEMS 4
#endif
constexpr int kThreads = CRF_PLACE_THREADS;  // a power of two (the tree reduction)
constexpr int kItems = CRF_PLACE_ITEMS;      // mask bytes per thread and window
constexpr int kWindow = kThreads * kItems;

struct Params {
  const float* rr;              // [R] rollout rewards
  const bool* mask;             // [T]
  const void *cu_seq, *cu_seg;  // [S+1], [R+1], int32 or int64
  int64_t T, S, R;
  bool stitched;
  float* out;                   // [T]
};

__device__ __forceinline__ int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : (x > hi ? hi : x); }

__global__ void __launch_bounds__(kThreads) zero_kernel(float* out, int64_t T) {
  const int64_t step = (int64_t)gridDim.x * kThreads;
  for (int64_t t = (int64_t)blockIdx.x * kThreads + threadIdx.x; t < T; t += step) out[t] = 0.0f;
}

template <typename idx_t>
__global__ void __launch_bounds__(kThreads) place_kernel(Params p) {
  __shared__ int64_t best[kThreads];
  const idx_t* cu = static_cast<const idx_t*>(p.cu_seq);
  const idx_t* cg = static_cast<const idx_t*>(p.cu_seg);
  const int64_t r = blockIdx.x;
  const int64_t s0 = clamp64(cg[r], 0, p.S), s1 = clamp64(cg[r + 1], s0, p.S);
  for (int64_t s = s1 - 1; s >= s0; --s) {
    const int64_t b = clamp64(cu[s], 0, p.T), e = clamp64(cu[s + 1], b, p.T);
    int64_t last = -1;  // the same in every thread (read from shared memory): the loops are block-uniform
    for (int64_t hi = e; hi > b && last < 0; hi -= kWindow) {
      int64_t mine = -1;  // the thread's bytes hi-1-threadIdx.x, hi-1-threadIdx.x-kThreads, ...: the first hit
      for (int k = 0; k < kItems && mine < 0; ++k) {
        const int64_t t = hi - 1 - threadIdx.x - (int64_t)k * kThreads;
        if (t >= b && p.mask[t]) mine = t;
      }
      best[threadIdx.x] = mine;
      __syncthreads();
      for (int w = kThreads / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w && best[threadIdx.x + w] > best[threadIdx.x]) best[threadIdx.x] = best[threadIdx.x + w];
        __syncthreads();
      }
      last = best[0];
      __syncthreads();  // every thread has read best[0] before the next window writes it
    }
    if (last >= 0) {
      if (threadIdx.x == 0) p.out[last] = p.rr[r];
      if (p.stitched) break;
    }
  }
}

// Both kernels on `stream`, in order (the zeros first).
inline void launch(const Params& p, bool is64, cudaStream_t stream) {
  if (p.T == 0) return;
  const int64_t blocks = (p.T + kWindow - 1) / kWindow;
  CRF_LAUNCH(zero_kernel, (unsigned)(blocks < 65536 ? blocks : 65536), kThreads, stream, p.out, p.T);
  if (p.R == 0) return;
  if (is64)
    CRF_LAUNCH(place_kernel<int64_t>, (unsigned)p.R, kThreads, stream, p);
  else
    CRF_LAUNCH(place_kernel<int32_t>, (unsigned)p.R, kThreads, stream, p);
}

}  // namespace place_cuda
}  // namespace crf
