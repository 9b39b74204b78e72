// Torch binding of the CUDA value_loss kernels (csrc/cuda/value_loss_kernels.cuh). Schema: csrc/schemas.cpp;
// Python semantics: compactionrl_fast/ops/value_loss.py.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>
#include <torch/types.h>

#include "../common/alloc.h"
#include "../common/loss_inputs.h"
#include "value_loss_kernels.cuh"

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> value_loss_cuda(
    const at::Tensor& values, const at::Tensor& old_values, const at::Tensor& returns, const at::Tensor& loss_mask,
    const std::optional<at::Tensor>& cu_seqlens, const at::Tensor& seg_scale, double clip, bool need_grad) {
  namespace K = crf::value_cuda;
  const int64_t T = values.numel();
  const int64_t S =
      crf::check_value_inputs(values, old_values, returns, loss_mask, cu_seqlens, seg_scale, /*cuda=*/true);
  const c10::cuda::CUDAGuard guard(values.device());
  auto f32 = values.options();
  at::Tensor grad = crf::grad_output(need_grad, T, f32);
  at::Tensor part = at::empty({K::n_blocks(T), K::kParts}, f32.dtype(at::kDouble));
  at::Tensor loss = at::empty({}, f32), metrics = at::empty({3}, f32);
  K::Params p{values.data_ptr<float>(), old_values.data_ptr<float>(), returns.data_ptr<float>(),
              loss_mask.data_ptr<bool>(), cu_seqlens ? cu_seqlens->data_ptr() : nullptr, seg_scale.data_ptr<double>(),
              S, T, (float)clip, clip, need_grad ? grad.data_ptr<float>() : nullptr, part.data_ptr<double>(),
              loss.data_ptr<float>(), metrics.data_ptr<float>()};
  K::launch(p, cu_seqlens && cu_seqlens->scalar_type() == at::kLong, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {loss, metrics, grad};
}

}  // namespace

TORCH_LIBRARY_IMPL(compactionrl_fast, CUDA, m) { m.impl("value_loss", &value_loss_cuda); }
