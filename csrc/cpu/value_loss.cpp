// value_loss on CPU: one pass computes the per-token loss, the per-token gradient (times its reduction
// weight) and per-block partials of the loss and the metrics; the partials are combined in block order,
// so the result is bitwise the same for any thread count. Variances for the explained variance are
// combined from per-block (count, sum, sum of squared deviations) (Chan et al.), which does not cancel
// when the returns have a large mean.
// Python-facing semantics: compactionrl_fast/ops/value_loss.py; per-token math: csrc/common/ppo_math.h.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <limits>

#include "../common/alloc.h"
#include "../common/loss_inputs.h"

// The kernel code, with the per-token math, is compiled with -fno-trapping-math (segment_runs.h says why).
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")
#include "../common/ppo_math.h"
#include "segment_runs.h"

namespace {

// Per-block partials, in this order. e = returns - values.
enum { kLoss, kTokens, kClipped, kSumV, kSumR, kM2R, kSumE, kM2E, kParts };

template <typename idx_t>
struct Args {
  const float *v, *old, *ret;
  const bool* mask;
  const idx_t* cu;      // [S+1] or nullptr (one segment)
  const double* scale;  // [S]
  int64_t S, T;
  float eps;
  float* grad;   // [T] or nullptr
  double* part;  // [n_blocks, kParts]
};

// Merge the (count, sum, sum of squared deviations) of a chunk into those of the block (Chan et al.);
// `n` is the block's count before the merge.
CRF_INLINE void merge_moments(double n, double& sum, double& m2, double nb, double sb, double m2b) {
  if (nb <= 0.0) return;
  if (n <= 0.0) {
    sum = sb;
    m2 = m2b;
    return;
  }
  const double d = sb / nb - sum / n;
  m2 += m2b + d * d * n * nb / (n + nb);
  sum += sb;
}

// Per-token buffers of a chunk: masked per-token loss, v, R, e = R - v, 1, clipped; scratch.
enum { L, V, R, E, N, C, Q, NB };

// The map loop over tokens [t0, t0 + n) of one segment with reduction weight wf: writes the gradient
// (times wf) and the masked per-token terms into buf. The gradient times wf is weight_scale's plain
// product unless wf = 0 (W0), so only a chunk with wf = 0 runs weight_scale's selects.
template <typename idx_t, bool CLIP, bool GRAD, bool W0>
CRF_INLINE void value_map(const Args<idx_t>& a, int64_t t0, int64_t n, float wf, float (*buf)[crf::kChunk]) {
  const uint8_t* __restrict mask = reinterpret_cast<const uint8_t*>(a.mask) + t0;
  const float* __restrict vp = a.v + t0;
  const float* __restrict op = a.old + t0;
  const float* __restrict rp = a.ret + t0;
  float* __restrict grad = GRAD ? a.grad + t0 : nullptr;
  const float eps = a.eps;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t mi = mask[i];
    const bool m = mi != 0;
    const float v = vp[i], r = rp[i], e = r - v;
    const crf::ValueToken o = crf::value_token(v, CLIP ? op[i] : v, r, eps, CLIP);
    const float gw = W0 ? crf::weight_scale(o.dv, wf) : o.dv * wf;
    if (GRAD) grad[i] = m ? gw : 0.0f;
    buf[L][i] = m ? o.loss : 0.0f;
    buf[V][i] = m ? v : 0.0f;
    buf[R][i] = m ? r : 0.0f;
    buf[E][i] = m ? e : 0.0f;
    buf[N][i] = m ? 1.0f : 0.0f;
    buf[C][i] = m ? o.clipped : 0.0f;
  }
}

// Tokens [t0, t1) (at most kChunk) of one segment with reduction weight w; adds into p.
template <typename idx_t, bool CLIP, bool GRAD>
CRF_INLINE void value_chunk(const Args<idx_t>& a, int64_t t0, int64_t t1, double w, double* p) {
  float buf[NB][crf::kChunk];
  const int64_t n = t1 - t0;
  const float wf = (float)w;
  if (GRAD && wf == 0.0f)
    value_map<idx_t, CLIP, GRAD, true>(a, t0, n, wf, buf);
  else
    value_map<idx_t, CLIP, GRAD, false>(a, t0, n, wf, buf);
  const double nb = crf::lane_sum(buf[N], n);
  if (nb <= 0.0) return;
  // squared deviations of R and of e from the chunk's means (0 on masked tokens: buf[N] is 0 there)
  double m2[2];
  for (int k = 0; k < 2; ++k) {
    const float* x = buf[k == 0 ? R : E];
    const float mean = (float)(crf::lane_sum(x, n) / nb);
    for (int64_t i = 0; i < n; ++i) {
      const float d = x[i] - mean;
      buf[Q][i] = buf[N][i] * (d * d);
    }
    m2[k] = crf::lane_sum(buf[Q], n);
  }
  const double n0 = p[kTokens];
  p[kLoss] += crf::weight_scale(crf::lane_sum(buf[L], n), w);
  p[kClipped] += crf::lane_sum(buf[C], n);
  p[kSumV] += crf::lane_sum(buf[V], n);
  merge_moments(n0, p[kSumR], p[kM2R], nb, crf::lane_sum(buf[R], n), m2[0]);
  merge_moments(n0, p[kSumE], p[kM2E], nb, crf::lane_sum(buf[E], n), m2[1]);
  p[kTokens] = n0 + nb;
}

}  // namespace
#pragma GCC pop_options

namespace {

// Combine (n, sum, M2) of the blocks in order (Chan et al.); returns the population variance.
struct Moments {
  double n = 0.0, sum = 0.0, m2 = 0.0;
  void add(double nb, double sb, double m2b) {
    if (nb <= 0.0) return;
    const double delta = sb / nb - (n > 0.0 ? sum / n : 0.0);
    m2 += m2b + (n > 0.0 ? delta * delta * n * nb / (n + nb) : 0.0);
    n += nb;
    sum += sb;
  }
  double var() const { return n > 0.0 ? m2 / n : 0.0; }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> value_loss_cpu(
    const at::Tensor& values, const at::Tensor& old_values, const at::Tensor& returns, const at::Tensor& loss_mask,
    const std::optional<at::Tensor>& cu_seqlens, const at::Tensor& seg_scale, double clip, bool need_grad) {
  const int64_t T = values.numel();
  const int64_t S =
      crf::check_value_inputs(values, old_values, returns, loss_mask, cu_seqlens, seg_scale, /*cuda=*/false);
  if (cu_seqlens) crf::check_offsets_host("value_loss", *cu_seqlens, T);
  auto f32 = values.options();
  at::Tensor grad = crf::grad_output(need_grad, T, f32);
  const int64_t n_blocks = crf::n_blocks(T);
  at::Tensor part = at::empty({n_blocks, kParts}, f32.dtype(at::kDouble));

  crf::dispatch(cu_seqlens, clip >= 0.0, need_grad, [&](auto idx_tag, auto use_clip, auto grad_on) {
    using idx_t = decltype(idx_tag);
    Args<idx_t> a{values.data_ptr<float>(), old_values.data_ptr<float>(), returns.data_ptr<float>(),
                  loss_mask.data_ptr<bool>(), cu_seqlens ? cu_seqlens->data_ptr<idx_t>() : nullptr,
                  seg_scale.data_ptr<double>(), S, T, (float)clip, need_grad ? grad.data_ptr<float>() : nullptr,
                  part.data_ptr<double>()};
    crf::parallel_blocks<value_chunk<idx_t, use_clip, grad_on>, kParts>(a);
  });

  double loss = 0.0, n = 0.0, nc = 0.0, sv = 0.0;
  Moments mr, me;
  const double* p = part.data_ptr<double>();
  for (int64_t b = 0; b < n_blocks; ++b, p += kParts) {
    loss += p[kLoss];
    n += p[kTokens];
    nc += p[kClipped];
    sv += p[kSumV];
    mr.add(p[kTokens], p[kSumR], p[kM2R]);
    me.add(p[kTokens], p[kSumE], p[kM2E]);
  }
  const double inv = n > 0 ? 1.0 / n : 0.0, var_r = mr.var();
  at::Tensor metrics = at::empty({3}, f32);
  float* m = metrics.data_ptr<float>();
  m[0] = (float)(nc * inv);                                  // clip_fraction
  m[1] = (float)(sv * inv);                                  // value_mean
  m[2] = (float)(var_r <= 0.0 ? 0.0 : 1.0 - me.var() / var_r);  // explained_variance (NaN stays NaN)
  return {at::scalar_tensor(loss, f32), metrics, grad};
}

}  // namespace

TORCH_LIBRARY_IMPL(compactionrl_fast, CPU, m) { m.impl("value_loss", &value_loss_cpu); }
