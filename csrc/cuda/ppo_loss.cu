// Torch binding of the CUDA ppo_policy_loss kernels (csrc/cuda/ppo_loss_kernels.cuh). The schema is
// defined next to the CPU kernel (csrc/cpu/ppo_loss.cpp); Python semantics: compactionrl_fast/ops/ppo_loss.py.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>
#include <torch/types.h>

#include "../common/alloc.h"
#include "ppo_loss_kernels.cuh"

namespace {

void check_f32(const at::Tensor& t, const char* name, int64_t T) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kFloat && t.dim() == 1 && t.numel() == T && t.is_contiguous(),
              "ppo_policy_loss: ", name, " must be a contiguous float32 [T] CUDA tensor");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ppo_policy_loss_cuda(
    const at::Tensor& logprobs, const at::Tensor& old_logprobs, const at::Tensor& advantages,
    const at::Tensor& loss_mask, const std::optional<at::Tensor>& rollout_logprobs,
    const std::optional<at::Tensor>& cu_seqlens, const at::Tensor& seg_scale, double clip_low, double clip_high,
    double dual_clip, double tis_cap, bool need_grad) {
  namespace K = crf::ppo_cuda;
  const int64_t T = logprobs.numel();
  check_f32(logprobs, "logprobs", T);
  check_f32(old_logprobs, "old_logprobs", T);
  check_f32(advantages, "advantages", T);
  if (rollout_logprobs) check_f32(*rollout_logprobs, "rollout_logprobs", T);
  TORCH_CHECK(loss_mask.scalar_type() == at::kBool && loss_mask.numel() == T && loss_mask.is_contiguous(),
              "ppo_policy_loss: loss_mask must be a contiguous bool [T] tensor");
  const int64_t S = cu_seqlens ? cu_seqlens->numel() - 1 : 1;
  TORCH_CHECK(seg_scale.scalar_type() == at::kDouble && seg_scale.numel() == S && seg_scale.is_contiguous(),
              "ppo_policy_loss: seg_scale must be a contiguous float64 [S] tensor");
  TORCH_CHECK(!cu_seqlens || ((cu_seqlens->scalar_type() == at::kInt || cu_seqlens->scalar_type() == at::kLong) &&
                              cu_seqlens->is_contiguous()),
              "ppo_policy_loss: cu_seqlens must be a contiguous int32/int64 tensor");
  const c10::cuda::CUDAGuard guard(logprobs.device());
  auto f32 = logprobs.options();
  at::Tensor grad = need_grad ? crf::empty_output({T}, f32) : at::empty({0}, f32);
  at::Tensor part = at::empty({K::n_blocks(T), K::kParts}, f32);
  at::Tensor loss = at::empty({}, f32), metrics = at::empty({4}, f32);
  K::Params p{logprobs.data_ptr<float>(), old_logprobs.data_ptr<float>(), advantages.data_ptr<float>(),
              rollout_logprobs ? rollout_logprobs->data_ptr<float>() : nullptr, loss_mask.data_ptr<bool>(),
              cu_seqlens ? cu_seqlens->data_ptr() : nullptr, seg_scale.data_ptr<double>(), S, T,
              (float)(1.0 - clip_low), (float)(1.0 + clip_high), (float)dual_clip, (float)tis_cap,
              need_grad ? grad.data_ptr<float>() : nullptr, part.data_ptr<float>(), loss.data_ptr<float>(),
              metrics.data_ptr<float>()};
  K::launch(p, cu_seqlens && cu_seqlens->scalar_type() == at::kLong, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {loss, metrics, grad};
}

}  // namespace

TORCH_LIBRARY_IMPL(compactionrl_fast, CUDA, m) { m.impl("ppo_policy_loss", &ppo_policy_loss_cuda); }
