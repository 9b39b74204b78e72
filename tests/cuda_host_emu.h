// Host emulation of the CUDA kernels in csrc/cuda/*_kernels.cuh, for tests on machines without a GPU.
// Include it before the kernel header. A block's threads are std::threads, __syncthreads() is a
// std::barrier, __shared__ variables are function statics (blocks run one after another), and
// CRF_LAUNCH runs a kernel over its grid. Enough for kernels that use only threadIdx/blockIdx, shared
// memory and __syncthreads (no warp intrinsics, no atomics); it checks logic, not speed or memory order.
#pragma once
#include <barrier>
#include <thread>
#include <vector>

#define CRF_HOST_EMULATION 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static

struct crf_emu_dim {
  unsigned x = 0, y = 0, z = 0;
};
inline thread_local crf_emu_dim threadIdx, blockIdx;
inline crf_emu_dim blockDim, gridDim;
inline std::barrier<>* crf_emu_barrier = nullptr;
inline void __syncthreads() { crf_emu_barrier->arrive_and_wait(); }
using cudaStream_t = void*;

namespace crf_emu {

template <typename Kernel, typename... Args>
void launch(Kernel kernel, unsigned grid, unsigned block, Args... args) {
  std::barrier<> sync(block);
  crf_emu_barrier = &sync;
  gridDim.x = grid, blockDim.x = block;
  std::vector<std::thread> threads;
  for (unsigned i = 0; i < block; ++i)
    threads.emplace_back([&, i] {
      threadIdx.x = i;
      for (unsigned b = 0; b < grid; ++b) {
        blockIdx.x = b;
        kernel(args...);
        sync.arrive_and_wait();  // the next block reuses the shared memory
      }
    });
  for (auto& t : threads) t.join();
}

}  // namespace crf_emu

#define CRF_LAUNCH(kernel, grid, block, stream, ...) crf_emu::launch(kernel, grid, block, __VA_ARGS__)
