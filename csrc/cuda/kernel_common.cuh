// What the standalone CUDA kernel files (csrc/cuda/*_kernels.cuh) share. They include no torch headers:
// tests/test_aot.py compiles each on its own with nvcc, and the CPU tests build them with g++ over
// tests/cuda_host_emu.h, which defines CRF_HOST_EMULATION and its own CRF_LAUNCH before including them.
#pragma once
#ifndef CRF_HOST_EMULATION
#include <cuda_runtime.h>
#endif

#include <cstdint>

#ifndef CRF_LAUNCH
#define CRF_LAUNCH(kernel, grid, block, stream, ...) kernel<<<(grid), (block), 0, (stream)>>>(__VA_ARGS__)
#endif

// Block shape of the loss kernels (ppo_loss_kernels.cuh, value_loss_kernels.cuh); the host-emulation
// tests (tests/ops/losses_cuda_host.cpp) also build it small.
#ifndef CRF_LOSS_THREADS
#define CRF_LOSS_THREADS 256
#endif
#ifndef CRF_LOSS_ITEMS
#define CRF_LOSS_ITEMS 4
#endif

namespace crf {

// The last i in [0, n) with cu[i] <= t (cu non-decreasing, cu[0] <= t): with segment offsets cu and
// n = S, the segment of token t.
template <typename idx_t>
__device__ __forceinline__ int64_t upper_index(const idx_t* cu, int64_t n, int64_t t) {
  int64_t lo = 0, hi = n;
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) >> 1;
    if ((int64_t)cu[mid] <= t) lo = mid; else hi = mid;
  }
  return lo;
}

// The reduction weight of token t of a loss kernel's Params p (p.cu: [S+1] offsets of idx_t or null, p.scale:
// [S]). Bad offsets (unchecked on CUDA) only steer the binary search: the index stays in [0, S), so they give
// wrong weights, never an out-of-bounds read.
template <typename idx_t, typename P>
__device__ __forceinline__ double token_weight(const P& p, int64_t t) {
  const idx_t* cu = static_cast<const idx_t*>(p.cu);
  return cu == nullptr ? p.scale[0] : p.scale[upper_index(cu, p.S, t)];
}

}  // namespace crf
