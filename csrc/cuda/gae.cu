// Torch binding of the CUDA segment_gae kernels (csrc/cuda/gae_kernels.cuh). Schema: csrc/schemas.cpp;
// Python semantics and validation: compactionrl_fast/ops/gae.py.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>
#include <torch/types.h>

#include "../common/alloc.h"
#include "gae_kernels.cuh"

namespace {

void check_1d(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t n, const at::Device& dev) {
  TORCH_CHECK(t.device() == dev && t.scalar_type() == dtype && t.dim() == 1 && t.numel() == n,
              "segment_gae: ", name, " must be a ", c10::toString(dtype), " [", n, "] tensor on ", dev);
}

std::tuple<at::Tensor, at::Tensor> segment_gae_cuda(const at::Tensor& rewards, const at::Tensor& values,
                                                    const at::Tensor& loss_mask, const at::Tensor& cu_seqlens,
                                                    const at::Tensor& cu_segments,
                                                    const std::optional<at::Tensor>& lam_seg, double gamma,
                                                    double lam, int64_t lam_mode, double alpha, int64_t cross,
                                                    double lam_critic, const std::optional<at::Tensor>& seg_start) {
  namespace K = crf::gae_cuda;
  TORCH_CHECK_VALUE(!seg_start.has_value(), "segment_gae: seg_start (placed segments) needs the triton backend; "
                    "the cuda backend reads packed segments only");
  const at::Device dev = loss_mask.device();
  TORCH_CHECK(dev.is_cuda(), "segment_gae: loss_mask must be a CUDA tensor");
  const int64_t T = loss_mask.numel(), S = cu_seqlens.numel() - 1, R = cu_segments.numel() - 1;
  check_1d(loss_mask, "loss_mask", at::kBool, T, dev);
  check_1d(rewards, "rewards", at::kFloat, T, dev);
  check_1d(values, "values", at::kFloat, T, dev);
  const auto idx = cu_seqlens.scalar_type();
  TORCH_CHECK(idx == at::kInt || idx == at::kLong, "segment_gae: cu_seqlens must be int32 or int64");
  TORCH_CHECK(S >= 0 && R >= 0, "segment_gae: cu_seqlens and cu_segments need at least one entry");
  check_1d(cu_seqlens, "cu_seqlens", idx, S + 1, dev);
  check_1d(cu_segments, "cu_segments", idx, R + 1, dev);
  at::Tensor lam_t;
  if (lam_mode == crf::kLamTensor) {
    TORCH_CHECK(lam_seg.has_value(), "segment_gae: lam_mode=tensor needs lam_seg");
    lam_t = lam_seg->to(at::kFloat).contiguous();
    check_1d(lam_t, "lam_seg", at::kFloat, S, dev);
  }
  const c10::cuda::CUDAGuard guard(dev);
  auto rew = rewards.contiguous(), val = values.contiguous(), mask = loss_mask.contiguous();
  // The kernels index with the offsets; without a host read they cannot be checked, so make them safe on the
  // device (clamped, first 0, last the total, non-decreasing): a bad layout gives wrong numbers, not a fault.
  auto safe = [](const at::Tensor& cu, int64_t total, at::ScalarType dtype) {
    at::Tensor c = cu.to(at::kLong).clamp(0, total);
    if (c.numel() > 0) {
      c.select(0, 0).fill_(0);
      c.select(0, c.numel() - 1).fill_(total);
    }
    return std::get<0>(c.cummax(0)).to(dtype).contiguous();
  };
  auto cs = safe(cu_seqlens, T, idx), cg = safe(cu_segments, S, idx);
  auto adv = crf::empty_output({T}, rew.options()), ret = crf::empty_output({T}, rew.options());
  if (T == 0) return {adv, ret};
  // scratch: per-segment counts and numbers, per-tile carry maps and carry-ins
  const bool need_counts = crf::needs_counts(lam_mode, cross);
  auto f64 = rew.options().dtype(at::kDouble);
  at::Tensor counts = need_counts ? at::empty({S}, rew.options().dtype(at::kLong)) : at::Tensor();
  at::Tensor seg = at::empty({S, (int64_t)(sizeof(crf::SegParams) / sizeof(double))}, f64);
  const int64_t nt = K::n_tiles(T);
  at::Tensor maps = at::empty({nt, (int64_t)(sizeof(crf::GaeMap) / sizeof(double))}, f64);
  at::Tensor carry = at::empty({nt, (int64_t)(sizeof(crf::GaeState) / sizeof(double))}, f64);
  K::Params p{rew.data_ptr<float>(), val.data_ptr<float>(), mask.data_ptr<bool>(), cs.data_ptr(), cg.data_ptr(),
              lam_t.defined() ? lam_t.data_ptr<float>() : nullptr, T, S, R, gamma, lam, alpha, lam_critic,
              lam_mode, cross, need_counts ? counts.data_ptr<int64_t>() : nullptr,
              reinterpret_cast<crf::SegParams*>(seg.data_ptr<double>()),
              reinterpret_cast<crf::GaeMap*>(maps.data_ptr<double>()),
              reinterpret_cast<crf::GaeState*>(carry.data_ptr<double>()), adv.data_ptr<float>(),
              ret.data_ptr<float>()};
  K::launch(p, idx == at::kLong, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {adv, ret};
}

}  // namespace

TORCH_LIBRARY_IMPL(compactionrl_fast, CUDA, m) { m.impl("segment_gae", &segment_gae_cuda); }
