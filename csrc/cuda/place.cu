// Torch binding of the CUDA place_final_rewards kernels (csrc/cuda/place_kernels.cuh). Schema: csrc/schemas.cpp;
// Python semantics and validation: compactionrl_fast/ops/gae.py. No host read: the kernels clamp the offsets.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>
#include <torch/types.h>

#include "../common/alloc.h"
#include "place_kernels.cuh"

namespace {

at::Tensor place_final_rewards_cuda(const at::Tensor& rollout_rewards, const at::Tensor& loss_mask,
                                    const at::Tensor& cu_seqlens, const at::Tensor& cu_segments, bool stitched) {
  const at::Device dev = loss_mask.device();
  TORCH_CHECK(dev.is_cuda() && rollout_rewards.device() == dev && cu_seqlens.device() == dev &&
                  cu_segments.device() == dev,
              "place_final_rewards: all tensors must be on the same CUDA device");
  TORCH_CHECK_TYPE(loss_mask.scalar_type() == at::kBool && loss_mask.dim() == 1,
                   "place_final_rewards: loss_mask must be a bool [T] tensor");
  TORCH_CHECK_TYPE(at::isFloatingType(rollout_rewards.scalar_type()) && rollout_rewards.dim() == 1,
                   "place_final_rewards: rollout_rewards must be a float [R] tensor");
  const auto idx = cu_seqlens.scalar_type();
  TORCH_CHECK_TYPE((idx == at::kInt || idx == at::kLong) && cu_segments.scalar_type() == idx,
                   "place_final_rewards: cu_seqlens and cu_segments must share one dtype, int32 or int64");
  TORCH_CHECK_VALUE(cu_seqlens.dim() == 1 && cu_segments.dim() == 1 && cu_seqlens.numel() >= 1 &&
                        cu_segments.numel() >= 1,
                    "place_final_rewards: cu_seqlens and cu_segments must be 1-D with at least one element");
  const int64_t T = loss_mask.numel(), S = cu_seqlens.numel() - 1, R = cu_segments.numel() - 1;
  TORCH_CHECK_VALUE(rollout_rewards.numel() == R, "place_final_rewards: rollout_rewards must be [R] with R=", R,
                    ", got ", rollout_rewards.numel());
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
