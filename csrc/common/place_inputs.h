// The argument checks the CPU and CUDA bindings of place_final_rewards share (csrc/cpu/place.cpp,
// csrc/cuda/place.cu): dtypes, shapes and one device. The offsets' values are each kernel's business.
#pragma once
#include <ATen/ATen.h>

namespace crf {

// rollout_rewards float [R], loss_mask bool [T], cu_seqlens [S+1] and cu_segments [R+1] of one index dtype.
inline void check_place_inputs(const at::Tensor& rollout_rewards, const at::Tensor& loss_mask,
                               const at::Tensor& cu_seqlens, const at::Tensor& cu_segments) {
  const at::Device dev = loss_mask.device();
  TORCH_CHECK(rollout_rewards.device() == dev && cu_seqlens.device() == dev && cu_segments.device() == dev,
              "place_final_rewards: all tensors must be on one device");
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
  TORCH_CHECK_VALUE(rollout_rewards.numel() == cu_segments.numel() - 1, "place_final_rewards: rollout_rewards must "
                    "be [R] with R=", cu_segments.numel() - 1, ", got ", rollout_rewards.numel());
}

}  // namespace crf
