// C entry points running the CUDA ppo_policy_loss and value_loss kernels (csrc/cuda/*_loss_kernels.cuh)
// on the host through tests/cuda_host_emu.h; tests/ops/test_ppo_loss.py and test_value_loss.py build it
// with g++ and call it with ctypes in place of the cpp op. The partials buffer is allocated here as the
// torch bindings (csrc/cuda/ppo_loss.cu, value_loss.cu) allocate it on the GPU.
#include <vector>

#include "cuda_host_emu.h"
#include "cuda/ppo_loss_kernels.cuh"
#include "cuda/value_loss_kernels.cuh"

extern "C" void crf_ppo_loss_host(const float* logp, const float* old, const float* adv, const float* roll,
                                  const bool* mask, const void* cu, int is64, const double* scale, int64_t S,
                                  int64_t T, double clip_low, double clip_high, double dual_clip, double tis_cap,
                                  float* grad, float* loss, float* metrics) {
  namespace K = crf::ppo_cuda;
  std::vector<double> part(K::n_blocks(T) * K::kParts);
  K::Params p{logp, old, adv, roll, mask, cu, scale, S, T, (float)(1.0 - clip_low), (float)(1.0 + clip_high),
              (float)dual_clip, (float)tis_cap, 1.0 - clip_low, 1.0 + clip_high,
              crf::dual_clip_f64(dual_clip), tis_cap, grad, part.data(), loss, metrics};
  K::launch(p, is64 != 0, nullptr);
}

extern "C" void crf_value_loss_host(const float* v, const float* old, const float* ret, const bool* mask,
                                    const void* cu, int is64, const double* scale, int64_t S, int64_t T,
                                    double clip, float* grad, float* loss, float* metrics) {
  namespace K = crf::value_cuda;
  std::vector<double> part(K::n_blocks(T) * K::kParts);
  K::Params p{v, old, ret, mask, cu, scale, S, T, (float)clip, clip, grad, part.data(), loss, metrics};
  K::launch(p, is64 != 0, nullptr);
}
