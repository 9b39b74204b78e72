// ppo_policy_loss on CPU: one pass computes the per-token loss, the per-token gradient (already times
// its reduction weight) and per-block partial sums of the loss and the metrics; the partials are then
// added in block order, so the result is bitwise the same for any thread count.
// Python-facing semantics: compactionrl_fast/ops/ppo_loss.py; per-token math: csrc/common/ppo_math.h.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <cmath>
#include <limits>

#include "../common/alloc.h"
#include "../common/loss_inputs.h"

// The kernel code, with the per-token math, is compiled with -fno-trapping-math (segment_runs.h says why).
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")
#include "../common/ppo_math.h"
#include "segment_runs.h"

namespace {

// Per-block partial sums, in this order.
enum { kLoss, kTokens, kClipped, kDual, kKl, kLogRatio, kRatioMax, kParts };

template <typename idx_t>
struct Args {
  const float *logp, *old, *adv, *roll;
  const bool* mask;
  const idx_t* cu;      // [S+1] or nullptr (one segment)
  const double* scale;  // [S] reduction weight of each segment's tokens
  int64_t S, T;
  float ratio_lo, ratio_hi, dual_c, tis_cap;
  float* grad;     // [T] or nullptr
  double* part;    // [n_blocks, kParts]
};

// Per-token buffers of a chunk: masked per-token loss, kl, 1, clipped, dual, log ratio, ratio.
enum { L, K, N, C, D, X, R, NB };

// The map loop over tokens [t0, t0 + n) of one segment with reduction weight wf: writes the gradient
// (times wf) and the masked per-token terms into buf. EXACT = false is the fast pass: it leaves out the
// selects that only matter for w = 0 (0 * inf) and for a trainable token with A = 0 and an overflowed
// ratio, whose loss then comes out NaN; ppo_chunk redoes such a chunk with EXACT = true.
template <typename idx_t, bool TIS, bool GRAD, bool EXACT>
CRF_INLINE void ppo_map(const Args<idx_t>& a, int64_t t0, int64_t n, float wf, float (*buf)[crf::kChunk]) {
  const uint8_t* __restrict mask = reinterpret_cast<const uint8_t*>(a.mask) + t0;
  const float* __restrict lp = a.logp + t0;
  const float* __restrict old = a.old + t0;
  const float* __restrict adv = a.adv + t0;
  const float* __restrict roll = TIS ? a.roll + t0 : nullptr;
  float* __restrict grad = GRAD ? a.grad + t0 : nullptr;
  const float lo = a.ratio_lo, hi = a.ratio_hi, dc = a.dual_c, cap = a.tis_cap;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t mi = mask[i];
    const bool m = mi != 0;
    const float x = lp[i] - old[i];
    const crf::PpoToken o = crf::ppo_token<EXACT>(x, adv[i], lo, hi, dc);
    float l = o.loss, g = o.dlogp;
    if (TIS) {
      const float wi = crf::exp_f32(old[i] - roll[i]);
      const float wc = wi > cap ? cap : wi;  // a NaN weight stays NaN
      l = crf::tis_scale(l, wc);
      g = crf::tis_scale(g, wc);
    }
    const float gw = EXACT ? crf::weight_scale(g, wf) : g * wf, k = crf::kl_term(x, o.ratio);
    if (GRAD) grad[i] = m ? gw : 0.0f;
    buf[L][i] = m ? l : 0.0f;
    buf[K][i] = m ? k : 0.0f;
    buf[N][i] = m ? 1.0f : 0.0f;
    buf[C][i] = m ? o.clipped : 0.0f;
    buf[D][i] = m ? o.dual : 0.0f;
    buf[X][i] = m ? x : 0.0f;
    buf[R][i] = m ? o.ratio : 0.0f;
  }
}

// Tokens [t0, t1) (at most kChunk) of one segment with reduction weight w; adds into p.
template <typename idx_t, bool TIS, bool GRAD>
CRF_INLINE void ppo_chunk(const Args<idx_t>& a, int64_t t0, int64_t t1, double w, double* p) {
  float buf[NB][crf::kChunk];
  const int64_t n = t1 - t0;
  const float wf = (float)w;
  // The fast pass's results are the exact pass's unless w = 0 or a trainable token's loss is NaN (a NaN
  // input also does that); then the chunk is done again exactly. So the usual chunk skips two selects
  // per token, and a chunk with a NaN loss pays two passes.
  bool exact = wf == 0.0f;
  double loss = 0.0;
  if (!exact) {
    ppo_map<idx_t, TIS, GRAD, false>(a, t0, n, wf, buf);
    loss = crf::lane_sum(buf[L], n);
    exact = loss != loss;
  }
  if (exact) {
    ppo_map<idx_t, TIS, GRAD, true>(a, t0, n, wf, buf);
    loss = crf::lane_sum(buf[L], n);
  }
  p[kLoss] += crf::weight_scale(loss, w);
  const double kl = crf::lane_sum(buf[K], n);
  p[kKl] += kl;
  p[kTokens] += crf::lane_sum(buf[N], n);
  p[kClipped] += crf::lane_sum(buf[C], n);
  p[kDual] += crf::lane_sum(buf[D], n);
  p[kLogRatio] += crf::lane_sum(buf[X], n);
  double rm = crf::lane_max(buf[R], n);
  // lane_max drops NaN; a NaN ratio of a trainable token makes its KL term NaN too, so only then look
  // for it (a NaN log-prob must show in ratio_max, as in the reference)
  if (kl != kl)
    for (int64_t i = 0; i < n; ++i) rm = buf[R][i] != buf[R][i] ? buf[R][i] : rm;
  p[kRatioMax] = (rm > p[kRatioMax]) | (rm != rm) ? rm : p[kRatioMax];  // keeps a NaN
}

}  // namespace
#pragma GCC pop_options

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> ppo_policy_loss_cpu(
    const at::Tensor& logprobs, const at::Tensor& old_logprobs, const at::Tensor& advantages,
    const at::Tensor& loss_mask, const std::optional<at::Tensor>& rollout_logprobs,
    const std::optional<at::Tensor>& cu_seqlens, const at::Tensor& seg_scale, double clip_low, double clip_high,
    double dual_clip, double tis_cap, bool need_grad) {
  const int64_t T = logprobs.numel();
  const int64_t S =
      crf::check_ppo_inputs(logprobs, old_logprobs, advantages, loss_mask, rollout_logprobs, cu_seqlens, seg_scale,
                            /*cuda=*/false);
  if (cu_seqlens) crf::check_offsets_host("ppo_policy_loss", *cu_seqlens, T);
  auto f32 = logprobs.options();
  at::Tensor grad = crf::grad_output(need_grad, T, f32);
  const int64_t n_blocks = crf::n_blocks(T);
  at::Tensor part = at::empty({n_blocks, kParts}, f32.dtype(at::kDouble));

  crf::dispatch(cu_seqlens, rollout_logprobs.has_value(), need_grad, [&](auto idx_tag, auto tis, auto grad_on) {
    using idx_t = decltype(idx_tag);
    Args<idx_t> a{logprobs.data_ptr<float>(), old_logprobs.data_ptr<float>(), advantages.data_ptr<float>(),
                  rollout_logprobs ? rollout_logprobs->data_ptr<float>() : nullptr, loss_mask.data_ptr<bool>(),
                  cu_seqlens ? cu_seqlens->data_ptr<idx_t>() : nullptr, seg_scale.data_ptr<double>(), S, T,
                  (float)(1.0 - clip_low), (float)(1.0 + clip_high), (float)dual_clip, (float)tis_cap,
                  need_grad ? grad.data_ptr<float>() : nullptr, part.data_ptr<double>()};
    crf::parallel_blocks<ppo_chunk<idx_t, tis, grad_on>, kParts>(a);
  });

  // fixed-order reduction of the partials
  double tot[kParts] = {};
  const double* p = part.data_ptr<double>();
  for (int64_t b = 0; b < n_blocks; ++b, p += kParts) {
    for (int k = 0; k < kRatioMax; ++k) tot[k] += p[k];
    tot[kRatioMax] = (p[kRatioMax] > tot[kRatioMax]) | (p[kRatioMax] != p[kRatioMax]) ? p[kRatioMax] : tot[kRatioMax];
  }
  const double n = tot[kTokens], inv = n > 0 ? 1.0 / n : 0.0;
  at::Tensor loss = at::scalar_tensor(tot[kLoss], f32);
  at::Tensor metrics = at::empty({5}, f32);
  float* m = metrics.data_ptr<float>();
  m[0] = (float)(tot[kClipped] * inv);  // clip_fraction
  m[1] = (float)(tot[kDual] * inv);     // dual_clip_fraction
  m[2] = (float)(tot[kKl] * inv);       // approx_kl
  m[3] = (float)tot[kRatioMax];         // ratio_max (0 without trainable tokens)
  m[4] = (float)(tot[kLogRatio] * inv);  // log_ratio (mean of logp - old)
  return {loss, metrics, grad};
}

}  // namespace

TORCH_LIBRARY_IMPL(compactionrl_fast, CPU, m) { m.impl("ppo_policy_loss", &ppo_policy_loss_cpu); }
