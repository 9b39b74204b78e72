// Every schema of the `compactionrl_fast` op namespace, in one place. The per-device files register
// kernels only (TORCH_LIBRARY_IMPL: csrc/cpu/*.cpp for CPU, csrc/cuda/*.cu for CUDA); the Python-only ops
// (the Triton ones, linear_logprobs) are defined by torch.library.custom_op in compactionrl_fast/ops/.
#include <torch/library.h>

TORCH_LIBRARY(compactionrl_fast, m) {
  // GAE over packed segments (csrc/cpu/gae.cpp, csrc/cuda/gae.cu); lam_mode and cross: csrc/common/modes.h.
  m.def(
      "segment_gae(Tensor rewards, Tensor values, Tensor loss_mask, Tensor cu_seqlens, Tensor cu_segments, "
      "Tensor? lam_seg, float gamma, float lam, int lam_mode, float alpha, int cross, float lam_critic, "
      "Tensor? seg_start=None) -> (Tensor, Tensor)");
  // Its per-segment numbers alone, float64 [4, S] (csrc/cpu/gae.cpp; CUDA tensors: the Triton op).
  m.def(
      "segment_gae_params(Tensor loss_mask, Tensor cu_seqlens, Tensor cu_segments, Tensor? lam_seg, float gamma, "
      "float lam, int lam_mode, float alpha, int cross, float lam_critic) -> Tensor");
  // Final rewards placed on segments' last trainable tokens, float32 [T] (csrc/cpu/place.cpp, csrc/cuda/place.cu).
  m.def("place_final_rewards(Tensor rollout_rewards, Tensor loss_mask, Tensor cu_seqlens, Tensor cu_segments, "
        "bool stitched) -> Tensor");

  // Loss reductions' per-segment metadata (csrc/cpu/segment_counts.cpp, csrc/cpu/segment_weights.cpp);
  // reduction: csrc/common/modes.h.
  m.def("segment_counts(Tensor loss_mask, Tensor cu_seqlens) -> Tensor");
  m.def(
      "segment_weights(Tensor loss_mask, Tensor? cu_seqlens, Tensor? cu_segments, int reduction, float den, "
      "Tensor? den_t) -> Tensor");

  // Fused losses: (loss, metrics, weighted per-token gradient) (csrc/cpu/*_loss.cpp, csrc/cuda/*_loss.cu).
  m.def(
      "ppo_policy_loss(Tensor logprobs, Tensor old_logprobs, Tensor advantages, Tensor loss_mask, "
      "Tensor? rollout_logprobs, Tensor? cu_seqlens, Tensor seg_scale, float clip_low, float clip_high, "
      "float dual_clip, float tis_cap, bool need_grad) -> (Tensor, Tensor, Tensor)");
  m.def(
      "value_loss(Tensor values, Tensor old_values, Tensor returns, Tensor loss_mask, Tensor? cu_seqlens, "
      "Tensor seg_scale, float clip, bool need_grad) -> (Tensor, Tensor, Tensor)");

  // A 0/1 mask of a numeric dtype as bool, with int64 [2] (its True values, > 0 iff a value is neither 0 nor 1)
  // (csrc/cpu/mask_to_bool.cpp; the adapters' as_bool_mask).
  m.def("mask_to_bool(Tensor mask) -> (Tensor, Tensor)");

  // Value head (csrc/cpu/value_head.cpp).
  m.def("value_head_fwd(Tensor hidden, Tensor weight, Tensor? bias) -> Tensor");
  m.def("value_head_bwd(Tensor hidden, Tensor weight, Tensor grad, bool need_dh, bool need_dw) -> (Tensor, Tensor)");
}
