// C entry point running the CUDA place_final_rewards kernels (csrc/cuda/place_kernels.cuh) on the host through
// tests/cuda_host_emu.h; tests/ops/test_place.py builds it with g++ and calls it with ctypes.
#include "cuda_host_emu.h"
#include "cuda/place_kernels.cuh"

extern "C" void crf_place_host(const float* rr, const bool* mask, const void* cu_seq, const void* cu_seg, int64_t T,
                               int64_t S, int64_t R, int stitched, int is64, float* out) {
  crf::place_cuda::Params p{rr, mask, cu_seq, cu_seg, T, S, R, stitched != 0, out};
  crf::place_cuda::launch(p, is64 != 0, nullptr);
}
