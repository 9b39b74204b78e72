// value_loss on CPU: one pass computes the per-token loss, the per-token gradient (times its reduction
// weight) and per-block partials of the loss and the metrics; the partials are combined in block order,
// so the result is bitwise the same for any thread count. Variances for the explained variance are
// combined from per-block (count, sum, sum of squared deviations) (Chan et al.), which does not cancel
// when the returns have a large mean.
// Python-facing semantics: compactionrl_fast/ops/value_loss.py; per-token math: csrc/common/ppo_math.h.
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

// Per-block partials, in this order. e = returns - values.
enum { kLoss, kTokens, kClipped, kSumV, kSumR, kM2R, kSumE, kM2E, kParts };

// in_t: the inputs' and the gradient's type, float or double (a float64 input is computed in float64).
template <typename idx_t, typename in_t>
struct Args {
  const in_t *v, *old, *ret;
  const bool* mask;
  const idx_t* cu;      // [S+1] or nullptr (one segment)
  const double* scale;  // [S]
  int64_t S, T;
  float eps;
  in_t* grad;    // [T] or nullptr
  double* part;  // [n_blocks, kParts]
  double eps64;  // eps in float64 (the float64 pass)
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
// (times wf) and the masked per-token terms into buf, in float32. Its results are the float64 pass's
// (value_chunk_f64) rounded as long as every term is finite; value_chunk redoes the chunk in float64
// when one is not.
template <typename idx_t, bool CLIP, bool GRAD>
CRF_INLINE void value_map(const Args<idx_t, float>& a, int64_t t0, int64_t n, float wf, float (*buf)[crf::kChunk]) {
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
    const float gw = o.dv * wf;
    if (GRAD) grad[i] = m ? gw : 0.0f;
    buf[L][i] = m ? o.loss : 0.0f;
    buf[V][i] = m ? v : 0.0f;
    buf[R][i] = m ? r : 0.0f;
    buf[E][i] = m ? e : 0.0f;
    buf[N][i] = m ? 1.0f : 0.0f;
    buf[C][i] = m ? o.clipped : 0.0f;
  }
}

// The chunk [t0, t0 + n) of one segment with reduction weight w after the float32 pass (buf) found a sum or
// moment that is not finite. Sums and moments are formed again in float64; a token whose float32 loss is
// finite keeps the float32 pass's loss and gradient (the float64 ones rounded; its gradient keeps its
// bits); any other trainable token is done in float64 by crf::value_token_f64 (csrc/common/ppo_math.h; the
// CUDA kernel redoes the same tokens with it). float64 inputs (in_t = double) have no float32 pass (buf is
// null): every token is done here. Adds into p. noinline: the float32 loop stays small.
template <typename idx_t, typename in_t, bool CLIP, bool GRAD>
__attribute__((noinline)) void value_chunk_f64(const Args<idx_t, in_t>& a, int64_t t0, int64_t n, double w,
                                               double* p, const float (*buf)[crf::kChunk]) {
  constexpr bool f32 = std::is_same_v<in_t, float>;
  const double eps = a.eps64;
  double loss = 0.0, nb = 0.0, clips = 0.0, sv = 0.0, sr = 0.0, se = 0.0;
  for (int64_t i = t0; i < t0 + n; ++i) {
    if (!a.mask[i]) {  // the float32 pass wrote its 0 gradient
      if (GRAD && !f32) a.grad[i] = 0.0;
      continue;
    }
    const double v = a.v[i], ret = a.ret[i];
    nb += 1.0;
    sv += v;
    sr += ret;
    se += ret - v;
    const int64_t j = i - t0;
    if (f32 && std::isfinite(buf[L][j])) {
      loss += (double)buf[L][j] * w;
      clips += buf[C][j];
      continue;
    }
    const crf::ValueToken64 o = crf::value_token_f64(v, CLIP ? (double)a.old[i] : v, ret, CLIP ? eps : -1.0, w);
    loss += o.lw;
    if (GRAD) a.grad[i] = (in_t)o.grad;
    clips += o.clipped ? 1.0 : 0.0;
  }
  if (nb <= 0.0) return;
  double m2r = 0.0, m2e = 0.0;
  const double mr = sr / nb, me = se / nb;
  for (int64_t i = t0; i < t0 + n; ++i) {
    if (!a.mask[i]) continue;
    const double ret = a.ret[i], dr = ret - mr, de = (ret - (double)a.v[i]) - me;
    m2r += dr * dr;
    m2e += de * de;
  }
  const double n0 = p[kTokens];
  p[kLoss] += loss;
  p[kClipped] += clips;
  p[kSumV] += sv;
  merge_moments(n0, p[kSumR], p[kM2R], nb, sr, m2r);
  merge_moments(n0, p[kSumE], p[kM2E], nb, se, m2e);
  p[kTokens] = n0 + nb;
}

// Tokens [t0, t1) (at most kChunk) of one segment with reduction weight w, float32 inputs; adds into p.
template <typename idx_t, bool CLIP, bool GRAD>
CRF_INLINE void value_chunk32(const Args<idx_t, float>& a, int64_t t0, int64_t t1, double w, double* p) {
  float buf[NB][crf::kChunk];
  const int64_t n = t1 - t0;
  const float wf = (float)w;
  value_map<idx_t, CLIP, GRAD>(a, t0, n, wf, buf);
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
  const double loss = crf::lane_sum(buf[L], n), sv = crf::lane_sum(buf[V], n), sr = crf::lane_sum(buf[R], n),
               se = crf::lane_sum(buf[E], n);
  // a term that is not finite (NaN or inf input, a square past float32: the sums or moments are then inf
  // or NaN): the chunk again in float64, whose results these are otherwise (rounded)
  if (!std::isfinite(loss + sv + sr + se + m2[0] + m2[1])) {
    value_chunk_f64<idx_t, float, CLIP, GRAD>(a, t0, n, w, p, buf);
    return;
  }
  const double n0 = p[kTokens];
  p[kLoss] += loss * w;
  p[kClipped] += crf::lane_sum(buf[C], n);
  p[kSumV] += sv;
  merge_moments(n0, p[kSumR], p[kM2R], nb, sr, m2[0]);
  merge_moments(n0, p[kSumE], p[kM2E], nb, se, m2[1]);
  p[kTokens] = n0 + nb;
}

// The chunk function of the block walk: float32 inputs as above; float64 ones in float64 throughout.
template <typename idx_t, typename in_t, bool CLIP, bool GRAD>
CRF_INLINE void value_chunk(const Args<idx_t, in_t>& a, int64_t t0, int64_t t1, double w, double* p) {
  if constexpr (std::is_same_v<in_t, double>)
    value_chunk_f64<idx_t, in_t, CLIP, GRAD>(a, t0, t1 - t0, w, p, nullptr);
  else
    value_chunk32<idx_t, CLIP, GRAD>(a, t0, t1, w, p);
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
  auto f32 = values.options().dtype(at::kFloat);
  at::Tensor grad = crf::grad_output(need_grad, T, values.options());  // the inputs' type
  const int64_t n_blocks = crf::n_blocks(T);
  at::Tensor part = at::empty({n_blocks, kParts}, f32.dtype(at::kDouble));

  crf::dispatch_float(values, [&](auto in_tag) {
    using in_t = decltype(in_tag);
    crf::dispatch(cu_seqlens, clip >= 0.0, need_grad, [&](auto idx_tag, auto use_clip, auto grad_on) {
      using idx_t = decltype(idx_tag);
      Args<idx_t, in_t> a{values.data_ptr<in_t>(), old_values.data_ptr<in_t>(), returns.data_ptr<in_t>(),
                          loss_mask.data_ptr<bool>(), cu_seqlens ? cu_seqlens->data_ptr<idx_t>() : nullptr,
                          seg_scale.data_ptr<double>(), S, T, (float)clip,
                          need_grad ? grad.data_ptr<in_t>() : nullptr, part.data_ptr<double>(), clip};
      crf::parallel_blocks<value_chunk<idx_t, in_t, use_clip, grad_on>, kParts>(a);
    });
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
  return {at::scalar_tensor((double)(float)loss, f32), metrics, grad};  // past float32: inf
}

}  // namespace

TORCH_LIBRARY_IMPL(compactionrl_fast, CPU, m) { m.impl("value_loss", &value_loss_cpu); }
