// Input checks of the loss ops' torch bindings, shared by CPU (csrc/cpu/*_loss.cpp) and CUDA
// (csrc/cuda/*_loss.cu). The Python wrappers validate first (compactionrl_fast/ops/); these checks stop a
// direct torch.ops call from handing the kernels memory they would read out of bounds.
#pragma once
#include <ATen/ATen.h>

#include <optional>

namespace crf {

// `op: name must be a contiguous [T] tensor` of input 0's float type: float32, or on CPU also float64 (the CPU
// kernels compute a float64 input in float64; the CUDA ones read float32 only, docs/ops.md).
inline void check_float_input(const char* op, const at::Tensor& t, const char* name, int64_t T, bool cuda,
                              at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || (!cuda && dtype == at::kDouble), op, ": ", name, " must be float32",
              cuda ? "" : " or float64", ", got ", dtype);
  TORCH_CHECK((!cuda || t.is_cuda()) && t.scalar_type() == dtype && t.dim() == 1 && t.numel() == T &&
                  t.is_contiguous(),
              op, ": ", name, " must be a contiguous ", dtype, " [T] ", cuda ? "CUDA tensor" : "tensor",
              " (the float type of the op's first input)");
}

// loss_mask, seg_scale and cu_seqlens (optional), all contiguous; returns S, the number of segments.
inline int64_t check_segments(const char* op, int64_t T, const at::Tensor& loss_mask,
                              const std::optional<at::Tensor>& cu_seqlens, const at::Tensor& seg_scale) {
  TORCH_CHECK(loss_mask.scalar_type() == at::kBool && loss_mask.numel() == T && loss_mask.is_contiguous(), op,
              ": loss_mask must be a contiguous bool [T] tensor");
  const int64_t S = cu_seqlens ? cu_seqlens->numel() - 1 : 1;
  // a shape check (no device read): tokens need a segment, or the kernels would read seg_scale[0] of []
  TORCH_CHECK_VALUE(S >= 1 || (S == 0 && T == 0), op, ": cu_seqlens must have at least 2 elements when T > 0, got ",
                    S + 1);
  TORCH_CHECK(seg_scale.scalar_type() == at::kDouble && seg_scale.numel() == S && seg_scale.is_contiguous(), op,
              ": seg_scale must be a contiguous float64 [S] tensor");
  TORCH_CHECK(!cu_seqlens || ((cu_seqlens->scalar_type() == at::kInt || cu_seqlens->scalar_type() == at::kLong) &&
                              cu_seqlens->is_contiguous()),
              op, ": cu_seqlens must be a contiguous int32/int64 tensor");
  return S;
}

// ppo_policy_loss's tensors; returns S.
inline int64_t check_ppo_inputs(const at::Tensor& logprobs, const at::Tensor& old_logprobs,
                                const at::Tensor& advantages, const at::Tensor& loss_mask,
                                const std::optional<at::Tensor>& rollout_logprobs,
                                const std::optional<at::Tensor>& cu_seqlens, const at::Tensor& seg_scale, bool cuda) {
  const char* op = "ppo_policy_loss";
  const int64_t T = logprobs.numel();
  const at::ScalarType dt = logprobs.scalar_type();
  check_float_input(op, logprobs, "logprobs", T, cuda, dt);
  check_float_input(op, old_logprobs, "old_logprobs", T, cuda, dt);
  check_float_input(op, advantages, "advantages", T, cuda, dt);
  if (rollout_logprobs) check_float_input(op, *rollout_logprobs, "rollout_logprobs", T, cuda, dt);
  return check_segments(op, T, loss_mask, cu_seqlens, seg_scale);
}

// value_loss's tensors; returns S.
inline int64_t check_value_inputs(const at::Tensor& values, const at::Tensor& old_values, const at::Tensor& returns,
                                  const at::Tensor& loss_mask, const std::optional<at::Tensor>& cu_seqlens,
                                  const at::Tensor& seg_scale, bool cuda) {
  const char* op = "value_loss";
  const int64_t T = values.numel();
  const at::ScalarType dt = values.scalar_type();
  check_float_input(op, values, "values", T, cuda, dt);
  check_float_input(op, old_values, "old_values", T, cuda, dt);
  check_float_input(op, returns, "returns", T, cuda, dt);
  return check_segments(op, T, loss_mask, cu_seqlens, seg_scale);
}

}  // namespace crf
