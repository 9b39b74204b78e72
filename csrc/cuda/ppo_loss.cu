// Torch binding of the CUDA ppo_policy_loss kernels (csrc/cuda/ppo_loss_kernels.cuh). Schema:
// csrc/schemas.cpp; Python semantics: compactionrl_fast/ops/ppo_loss.py.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>
#include <torch/types.h>

#include "../common/alloc.h"
#include "../common/loss_inputs.h"
#include "ppo_loss_kernels.cuh"

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> ppo_policy_loss_cuda(
    const at::Tensor& logprobs, const at::Tensor& old_logprobs, const at::Tensor& advantages,
    const at::Tensor& loss_mask, const std::optional<at::Tensor>& rollout_logprobs,
    const std::optional<at::Tensor>& cu_seqlens, const at::Tensor& seg_scale, double clip_low, double clip_high,
    double dual_clip, double tis_cap, bool need_grad) {
  namespace K = crf::ppo_cuda;
  const int64_t T = logprobs.numel();
  const int64_t S =
      crf::check_ppo_inputs(logprobs, old_logprobs, advantages, loss_mask, rollout_logprobs, cu_seqlens, seg_scale,
                            /*cuda=*/true);
  const c10::cuda::CUDAGuard guard(logprobs.device());
  auto f32 = logprobs.options();
  at::Tensor grad = crf::grad_output(need_grad, T, f32);
  at::Tensor part = at::empty({K::n_blocks(T), K::kParts}, f32.dtype(at::kDouble));
  at::Tensor loss = at::empty({}, f32), metrics = at::empty({5}, f32);
  K::Params p{logprobs.data_ptr<float>(), old_logprobs.data_ptr<float>(), advantages.data_ptr<float>(),
              rollout_logprobs ? rollout_logprobs->data_ptr<float>() : nullptr, loss_mask.data_ptr<bool>(),
              cu_seqlens ? cu_seqlens->data_ptr() : nullptr, seg_scale.data_ptr<double>(), S, T,
              (float)(1.0 - clip_low), (float)(1.0 + clip_high), (float)dual_clip, (float)tis_cap, 1.0 - clip_low,
              1.0 + clip_high, crf::dual_clip_f64(dual_clip), tis_cap,
              need_grad ? grad.data_ptr<float>() : nullptr, part.data_ptr<double>(), loss.data_ptr<float>(),
              metrics.data_ptr<float>()};
  K::launch(p, cu_seqlens && cu_seqlens->scalar_type() == at::kLong, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {loss, metrics, grad};
}

}  // namespace

TORCH_LIBRARY_IMPL(compactionrl_fast, CUDA, m) { m.impl("ppo_policy_loss", &ppo_policy_loss_cuda); }
