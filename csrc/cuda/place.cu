// Torch binding of the CUDA place_final_rewards kernels (csrc/cuda/place_kernels.cuh). Schema: csrc/schemas.cpp;
// Python semantics and validation: compactionrl_fast/ops/gae.py. No host read: the kernels clamp the offsets.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>
#include <torch/types.h>

#include "../common/alloc.h"
#include "../common/place_inputs.h"
#include "place_kernels.cuh"

namespace {

at::Tensor place_final_rewards_cuda(const at::Tensor& rollout_rewards, const at::Tensor& loss_mask,
                                    const at::Tensor& cu_seqlens, const at::Tensor& cu_segments, bool stitched) {
  const at::Device dev = loss_mask.device();
  TORCH_CHECK(dev.is_cuda(), "place_final_rewards: all tensors must be on the same CUDA device");
  crf::check_place_inputs(rollout_rewards, loss_mask, cu_seqlens, cu_segments);
  const auto idx = cu_seqlens.scalar_type();
  const int64_t T = loss_mask.numel(), S = cu_seqlens.numel() - 1, R = cu_segments.numel() - 1;
  const c10::cuda::CUDAGuard guard(dev);
  auto rr = rollout_rewards.to(at::kFloat).contiguous(), mask = loss_mask.contiguous();
  auto cs = cu_seqlens.contiguous(), cg = cu_segments.contiguous();
  at::Tensor out = crf::empty_output({T}, rr.options());
  crf::place_cuda::Params p{rr.data_ptr<float>(), mask.data_ptr<bool>(), cs.data_ptr(), cg.data_ptr(), T, S, R,
                            stitched, out.data_ptr<float>()};
  crf::place_cuda::launch(p, idx == at::kLong, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(compactionrl_fast, CUDA, m) { m.impl("place_final_rewards", &place_final_rewards_cuda); }
