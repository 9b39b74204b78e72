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

// in_t: the inputs' and the gradient's type, float or double (a float64 input is computed in float64).
template <typename idx_t, typename in_t>
struct Args {
  const in_t *logp, *old, *adv, *roll;
  const bool* mask;
  const idx_t* cu;      // [S+1] or nullptr (one segment)
  const double* scale;  // [S] reduction weight of each segment's tokens
  int64_t S, T;
  float ratio_lo, ratio_hi, dual_c, tis_cap;
  in_t* grad;      // [T] or nullptr
  double* part;    // [n_blocks, kParts]
  double lo64, hi64, dual64, cap64;  // the same in float64 (the float64 pass); dual64 = 0: no dual clip
};

// Per-token buffers of a chunk: masked per-token loss, kl, 1, clipped, dual, log ratio, ratio.
enum { L, K, N, C, D, X, R, NB };

// The map loop over tokens [t0, t0 + n) of one segment with reduction weight wf: writes the gradient
// (times wf) and the masked per-token terms into buf, in float32. Its results are the float64 pass's
// (ppo_chunk_f64) rounded, as long as every trainable token's terms are finite; ppo_chunk redoes a chunk in
// float64 when they are not (its loss or KL sum is not finite).
template <typename idx_t, bool TIS, bool GRAD>
CRF_INLINE void ppo_map(const Args<idx_t, float>& a, int64_t t0, int64_t n, float wf, float (*buf)[crf::kChunk]) {
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
    const crf::PpoToken o = crf::ppo_token<false>(x, adv[i], lo, hi, dc);
    float l = o.loss, g = o.dlogp;
    if (TIS) {
      const float wi = crf::exp_f32(old[i] - roll[i]);
      const float wc = wi > cap ? cap : wi;  // a NaN weight stays NaN; an overflowed one makes l NaN or inf
      l = l * wc;
      g = g * wc;
    }
    const float gw = g * wf, k = crf::kl_term(x, o.ratio);
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

// The chunk [t0, t0 + n) of one segment with reduction weight w after the float32 pass (buf) found a term
// that is not finite. A token whose float32 loss and KL term are finite keeps the float32 pass's results
// (they are the float64 ones rounded; its gradient keeps its bits); any other trainable token is done in
// float64 by crf::ppo_token_f64 (csrc/common/ppo_math.h; the CUDA kernel redoes the same tokens with it).
// float64 inputs (in_t = double) have no float32 pass (buf is null): every token is done here.
// Adds into p. noinline: the float32 loop stays small.
template <typename idx_t, typename in_t, bool TIS, bool GRAD>
__attribute__((noinline)) void ppo_chunk_f64(const Args<idx_t, in_t>& a, int64_t t0, int64_t n, double w, double* p,
                                             const float (*buf)[crf::kChunk]) {
  constexpr bool f32 = std::is_same_v<in_t, float>;
  const double lo = a.lo64, hi = a.hi64, c = a.dual64, cap = a.cap64;
  double loss = 0.0, tokens = 0.0, clips = 0.0, duals = 0.0, kl = 0.0, lr = 0.0, rm = p[kRatioMax];
  for (int64_t i = t0; i < t0 + n; ++i) {
    if (!a.mask[i]) {  // the float32 pass wrote its 0 gradient
      if (GRAD && !f32) a.grad[i] = 0.0;
      continue;
    }
    const int64_t j = i - t0;
    if (f32 && std::isfinite(buf[L][j]) && std::isfinite(buf[K][j])) {
      loss += (double)buf[L][j] * w;
      tokens += 1.0;
      clips += buf[C][j];
      duals += buf[D][j];
      kl += buf[K][j];
      lr += buf[X][j];
      rm = rm != rm ? rm : (buf[R][j] > rm ? (double)buf[R][j] : rm);
      continue;
    }
    const double old = a.old[i], x = (double)a.logp[i] - old, d = TIS ? old - (double)a.roll[i] : 0.0;
    const crf::PpoToken64 o = crf::ppo_token_f64<TIS>(x, a.adv[i], d, w, lo, hi, c, cap);
    loss += o.lw;
    if (GRAD) a.grad[i] = (in_t)o.grad;
    tokens += 1.0;
    clips += o.clipped ? 1.0 : 0.0;
    duals += o.dual ? 1.0 : 0.0;
    kl += o.kl;
    lr += x;
    const double r = o.ratio;
    rm = rm != rm ? rm : ((r > rm) | (r != r) ? r : rm);  // the max, a NaN kept
  }
  p[kLoss] += loss;
  p[kTokens] += tokens;
  p[kClipped] += clips;
  p[kDual] += duals;
  p[kKl] += kl;
  p[kLogRatio] += lr;
  p[kRatioMax] = rm;
}

// Tokens [t0, t1) (at most kChunk) of one segment with reduction weight w, float32 inputs; adds into p.
template <typename idx_t, bool TIS, bool GRAD>
CRF_INLINE void ppo_chunk32(const Args<idx_t, float>& a, int64_t t0, int64_t t1, double w, double* p) {
  float buf[NB][crf::kChunk];
  const int64_t n = t1 - t0;
  const float wf = (float)w;
  // The float32 pass's results are the float64 pass's, rounded, unless a trainable token has a term that is
  // not finite (NaN input, an overflowed ratio or product: the chunk's loss or KL sum is then inf or NaN);
  // such a chunk is done again in float64. So the usual chunk pays one vectorised pass.
  ppo_map<idx_t, TIS, GRAD>(a, t0, n, wf, buf);
  const double loss = crf::lane_sum(buf[L], n), kl = crf::lane_sum(buf[K], n);
  if (!std::isfinite(loss) || !std::isfinite(kl)) {
    ppo_chunk_f64<idx_t, float, TIS, GRAD>(a, t0, n, w, p, buf);
    return;
  }
  p[kLoss] += loss * w;
  p[kKl] += kl;
  p[kTokens] += crf::lane_sum(buf[N], n);
  p[kClipped] += crf::lane_sum(buf[C], n);
  p[kDual] += crf::lane_sum(buf[D], n);
  p[kLogRatio] += crf::lane_sum(buf[X], n);
  const double rm = crf::lane_max(buf[R], n);  // finite here (a NaN or inf ratio makes the KL sum so)
  const double pm = p[kRatioMax];
  p[kRatioMax] = pm != pm ? pm : (rm > pm ? rm : pm);
}

// The chunk function of the block walk: float32 inputs as above; float64 ones in float64 throughout.
template <typename idx_t, typename in_t, bool TIS, bool GRAD>
CRF_INLINE void ppo_chunk(const Args<idx_t, in_t>& a, int64_t t0, int64_t t1, double w, double* p) {
  if constexpr (std::is_same_v<in_t, double>)
    ppo_chunk_f64<idx_t, in_t, TIS, GRAD>(a, t0, t1 - t0, w, p, nullptr);
  else
    ppo_chunk32<idx_t, TIS, GRAD>(a, t0, t1, w, p);
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
  auto f32 = logprobs.options().dtype(at::kFloat);
  at::Tensor grad = crf::grad_output(need_grad, T, logprobs.options());  // the inputs' type
  const int64_t n_blocks = crf::n_blocks(T);
  at::Tensor part = at::empty({n_blocks, kParts}, f32.dtype(at::kDouble));

  crf::dispatch_float(logprobs, [&](auto in_tag) {
    using in_t = decltype(in_tag);
    crf::dispatch(cu_seqlens, rollout_logprobs.has_value(), need_grad, [&](auto idx_tag, auto tis, auto grad_on) {
      using idx_t = decltype(idx_tag);
      Args<idx_t, in_t> a{logprobs.data_ptr<in_t>(), old_logprobs.data_ptr<in_t>(), advantages.data_ptr<in_t>(),
                          rollout_logprobs ? rollout_logprobs->data_ptr<in_t>() : nullptr, loss_mask.data_ptr<bool>(),
                          cu_seqlens ? cu_seqlens->data_ptr<idx_t>() : nullptr, seg_scale.data_ptr<double>(), S, T,
                          (float)(1.0 - clip_low), (float)(1.0 + clip_high), (float)dual_clip, (float)tis_cap,
                          need_grad ? grad.data_ptr<in_t>() : nullptr, part.data_ptr<double>(), 1.0 - clip_low,
                          1.0 + clip_high, crf::dual_clip_f64(dual_clip), tis_cap};
      crf::parallel_blocks<ppo_chunk<idx_t, in_t, tis, grad_on>, kParts>(a);
    });
  });

  // fixed-order reduction of the partials
  double tot[kParts] = {};
  const double* p = part.data_ptr<double>();
  for (int64_t b = 0; b < n_blocks; ++b, p += kParts) {
    for (int k = 0; k < kRatioMax; ++k) tot[k] += p[k];
    tot[kRatioMax] = (p[kRatioMax] > tot[kRatioMax]) | (p[kRatioMax] != p[kRatioMax]) ? p[kRatioMax] : tot[kRatioMax];
  }
  const double n = tot[kTokens], inv = n > 0 ? 1.0 / n : 0.0;
  at::Tensor loss = at::scalar_tensor((double)(float)tot[kLoss], f32);  // past float32: inf
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
