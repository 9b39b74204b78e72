// C entry point running the CUDA segment_gae kernels (csrc/cuda/gae_kernels.cuh) on the host through
// tests/cuda_host_emu.h; tests/ops/test_gae.py builds it with g++ and calls it with ctypes. Scratch
// buffers are allocated here as csrc/cuda/gae.cu allocates them on the GPU.
#include "cuda_host_emu.h"
#include "cuda/gae_kernels.cuh"

extern "C" void crf_gae_host(const float* rew, const float* val, const bool* mask, const void* cu_seq,
                             const void* cu_seg, const float* lam_seg, int64_t T, int64_t S, int64_t R, double gamma,
                             double lam, double alpha, double lam_critic, int64_t lam_mode, int64_t cross, int is64,
                             float* adv, float* ret) {
  namespace K = crf::gae_cuda;
  const bool need_counts = crf::needs_counts(lam_mode, cross);
  std::vector<int64_t> counts(need_counts ? S : 0, -1);
  std::vector<crf::SegParams> seg(S);
  std::vector<crf::GaeMap> maps(K::n_tiles(T));
  std::vector<crf::GaeState> carry(K::n_tiles(T));
  K::Params p{rew, val, mask, cu_seq, cu_seg, lam_seg, T, S, R, gamma, lam, alpha, lam_critic, lam_mode, cross,
              need_counts ? counts.data() : nullptr, seg.data(), maps.data(), carry.data(), adv, ret};
  K::launch(p, is64 != 0, nullptr);
}
