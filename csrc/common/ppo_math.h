// Per-token math of the clipped-PPO policy loss and the clipped value loss, shared by the CPU
// (csrc/cpu/ppo_loss.cpp, value_loss.cpp) and CUDA (csrc/cuda/*_kernels.cuh) kernels, so the CPU tests
// exercise the CUDA arithmetic too. Everything is branch-free float32 so the CPU loops vectorise: both
// sides of every select are computed first (with the default -ftrapping-math, gcc does not if-convert
// a select whose arm does float arithmetic, and a loop with control flow is not vectorised).
// Semantics: docs/ops.md and compactionrl_fast/reference/losses.py.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

// Host/device and always inlined: a plain `inline` callee is not inlined into the AVX2-targeted CPU
// loops (different target options), which then call it per token instead of vectorising.
#if defined(__CUDACC__)
#define CRF_HDI __host__ __device__ __forceinline__
#else
#define CRF_HDI inline __attribute__((always_inline))
#endif

namespace crf {

CRF_HDI float bits_to_float(int32_t i) {
  float f;
  memcpy(&f, &i, sizeof f);
  return f;
}

CRF_HDI int32_t float_to_bits(float f) {
  int32_t i;
  memcpy(&i, &f, sizeof i);
  return i;
}

// e^x in float32 within ~2 ulp (Cephes expf), written without calls or branches so that the host
// compiler vectorises it; NaN stays NaN, large x gives inf, very negative x gives 0.
CRF_HDI float exp_f32(float x) {
  float xc = x > 88.7228f ? 88.7228f : (x < -104.0f ? -104.0f : x);
  // round(xc / ln2) with the 1.5 * 2^23 trick: exact for |n| < 2^22, no rint/floor needed
  const float t = xc * 1.44269504088896341f + 12582912.0f;
  const float fn = t - 12582912.0f;
  const int32_t n = float_to_bits(t) - 0x4B400000;
  float r = xc - fn * 0.693359375f;
  r = r - fn * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  // 2^n as two normal factors so that n in [-150, 128] neither overflows nor flushes early
  const int32_t n1 = n >> 1, n2 = n - n1;
  const float y = p * bits_to_float((n1 + 127) << 23) * bits_to_float((n2 + 127) << 23);
  return x > 88.7228f ? __builtin_huge_valf() : y;
}

// (e^x - 1) - x, the approximate-KL term with ratio = e^x, accurate also near x = 0 where the
// direct form cancels: a Taylor series for |x| < 0.5 (truncation < 1e-8 relative), else direct.
CRF_HDI float kl_term(float x, float ratio) {
  float s = 1.0f / 40320.0f;
  s = s * x + 1.0f / 5040.0f;
  s = s * x + 1.0f / 720.0f;
  s = s * x + 1.0f / 120.0f;
  s = s * x + 1.0f / 24.0f;
  s = s * x + 1.0f / 6.0f;
  s = s * x + 0.5f;
  const float small = s * x * x, direct = (ratio - 1.0f) - x, neg = -x;
  const float ax = x < 0.0f ? neg : x;
  return ax < 0.5f ? small : direct;
}

// One token of the clipped PPO objective (before the reduction weight).
//   ratio = e^x, x = logp - old_logp
//   l = max(-ratio*A, -clip(ratio, 1-eps_low, 1+eps_high)*A); for A < 0: l = min(l, -c*A)
// dlogp is d l / d logp: -A*ratio on the unclipped branch, 0 where a clip is active.
// `dual_c` = FLT_MAX switches the dual clip off without a branch (inf would make -c*0 a NaN).
// The flags are 0/1 floats: one lane type in the CPU loops (and no bool fields, which keep the struct in
// memory and stop gcc's vectoriser).
struct PpoToken {
  float loss;
  float dlogp;
  float ratio;
  float clipped;  // 1: the clipped branch is strictly larger (its gradient is zero)
  float dual;     // 1: the dual clip is active
};

// log(max double): a log-ratio above it overflows the float64 reference's ratio too.
constexpr float kLogRatioMax64 = 709.782712893384f;

// A0 = false leaves out the A = 0 overflow case below (such a token's loss and dlogp are then NaN, not 0):
// the CPU loop's fast pass, which redoes a chunk with A0 = true when a trainable token's loss is NaN.
template <bool A0 = true>
CRF_HDI PpoToken ppo_token(float x, float adv, float ratio_lo, float ratio_hi, float dual_c) {
  PpoToken o;
  o.ratio = exp_f32(x);
  const float rc = o.ratio < ratio_lo ? ratio_lo : (o.ratio > ratio_hi ? ratio_hi : o.ratio);
  // A = 0 with a ratio past float32 (x > ~88.7): the loss -A*ratio is 0 (the float64 reference and verl
  // say so), not 0 * inf = NaN. A NaN ratio stays NaN (NaN > max is false). Two plain selects: one on a
  // compound condition ((adv == 0) & (ratio > max)) keeps gcc from vectorising the CPU loop.
  // Past float64 too (x > ~709.78, or +inf) the ratio is inf in the reference as well: no cap, -0 * inf = NaN.
  const bool inf64 = x > kLogRatioMax64;
  const float rcap = o.ratio > 3.40282347e38f ? 3.40282347e38f : o.ratio;
  const float rl = A0 ? ((adv == 0.0f) & !inf64 ? rcap : o.ratio) : o.ratio;
  const float l1 = -adv * rl, l2 = -adv * rc;
  const bool clipped = l2 > l1;
  const float l = clipped ? l2 : l1;
  const float ld = -dual_c * adv;
  // dual_c = FLT_MAX is "off" also for an infinite l (inf > -FLT_MAX * A would switch it on)
  const bool dual = (adv < 0.0f) & (l > ld) & (dual_c < 3.40282347e38f);
  o.loss = dual ? ld : l;
  // the reference's chain rule: d/dlogp = (the taken branch's d/dratio) * ratio; a ratio past float64 times a
  // zero factor (clipped, dual-clipped, A = 0) is NaN there (docs/ops.md, "Non-finite input")
  const float g0 = A0 & inf64 ? bits_to_float(0x7fc00000) : 0.0f;
  o.dlogp = (clipped | dual) ? g0 : (A0 & inf64 & (adv == 0.0f) ? g0 : l1);
  o.clipped = clipped ? 1.0f : 0.0f;
  o.dual = dual ? 1.0f : 0.0f;
  return o;
}

// One token of the value loss: 0.5 * max((v-R)^2, (v_clip-R)^2), v_clip = old + clamp(v-old, -eps, eps),
// or 0.5 * (v-R)^2 without clip. dv = d loss / d v: (v-R) on the unclipped branch, else 0 (v_clip is
// constant in v exactly when the clip is active).
struct ValueToken {
  float loss;
  float dv;
  float clipped;  // 0/1, as in PpoToken
};

CRF_HDI ValueToken value_token(float v, float old_v, float ret, float eps, bool use_clip) {
  ValueToken o;
  const float e1 = v - ret;
  const float d = v - old_v;
  // v_clip - R: e1 itself inside the clip range (old + (v - old) may round away from v and fake a
  // clip), else (old - R) +- eps, which rounds once relative to the result (old +- eps, then - R,
  // would lose digits when |old| >> |v_clip - R|)
  const float outside = (old_v - ret) + (d < 0.0f ? -eps : eps);
  // written so that a NaN d (a NaN old value) takes `outside`, which is NaN too
  const float e2 = (d >= -eps) & (d <= eps) ? e1 : outside;
  const float q1 = e1 * e1, q2 = e2 * e2;
  const bool clipped = use_clip & (q2 > q1);
  // max(q1, q2) that keeps a NaN of either side, as torch.maximum in the reference does
  const bool nan2 = use_clip & (q2 != q2);
  o.loss = 0.5f * ((clipped | nan2) ? q2 : q1);
  // a NaN loss term gives a NaN gradient (docs/ops.md, "Non-finite input"), also for a NaN old value
  o.dv = nan2 ? q2 : (clipped ? 0.0f : e1);
  o.clipped = clipped ? 1.0f : 0.0f;
  return o;
}

// l * w for the truncated importance weight w = exp(d) (capped): 0 when l = 0 even if w overflowed float32
// but not float64 (d <= ~709.78: the float64 reference gives 0 there), NaN kept; past float64, 0 * inf = NaN.
CRF_HDI float tis_scale(float l, float w, float d) {
  const float wcap = (w > 3.40282347e38f) & (d <= kLogRatioMax64) ? 3.40282347e38f : w;
  const float lw = l * w, lwcap = l * wcap;
  return l == 0.0f ? lwcap : lw;
}

// l * w for a token's reduction weight w: 0 when w = 0 even if l overflowed float32 (a denominator of 0;
// the float64 reference gives 0 there), NaN kept. Two plain selects with both arms computed first: the
// one-line `w == 0 && l == l ? 0 : l * w` is control flow to gcc, and the CPU gradient loop that calls
// it would not be vectorised.
template <typename F>
CRF_HDI F weight_scale(F l, F w) {
  const F lw = l * w;
  const F zero = l == l ? F(0) : lw;
  return w == F(0) ? zero : lw;
}

// Whether f is finite (a bit test: right whatever the compiler's floating-point options).
CRF_HDI bool is_finite(float f) { return (float_to_bits(f) & 0x7f800000) != 0x7f800000; }

// One trainable token in float64, the reference's arithmetic (compactionrl_fast/reference/losses.py) written
// out, for the tokens whose float32 loss or KL term is not finite (the CPU and CUDA kernels redo those
// with it). x = logp - old and d = old - rollout log-prob in float64, w the token's reduction weight,
// dual_c = 0: no dual clip. lw = loss * w; grad = d lw / d logp as autograd forms it from these terms, term
// by term (a branch not taken passes 0 on, which times an infinite derivative is NaN), NaN where the loss
// is NaN.
struct PpoToken64 {
  double lw, grad, ratio, kl;
  bool clipped, dual;
};

// ppo_token_f64's dual_c from the op's dual_clip (float32 max or more: off).
inline double dual_clip_f64(double dual_clip) { return dual_clip < 3.4028234663852886e38 ? dual_clip : 0.0; }

template <bool TIS>
CRF_HDI PpoToken64 ppo_token_f64(double x, double adv, double d, double w, double lo, double hi, double dual_c,
                                 double cap) {
  PpoToken64 o;
  const double r = exp(x);
  const double rc = r < lo ? lo : (r > hi ? hi : r), na = -adv;
  const double l1 = na * r, l2 = na * rc;
  o.clipped = l2 > l1;
  double l = o.clipped ? l2 : l1;
  o.dual = false;
  if (dual_c != 0.0) {
    const double l3 = na * dual_c;
    o.dual = (adv < 0.0) && (l > l3);
    l = o.dual ? l3 : l;
  }
  double wis = 1.0;
  if (TIS) {
    wis = exp(d);
    wis = wis > cap ? cap : wis;  // NaN stays NaN
    l = l * wis;
  }
  const double gpre = o.dual ? 0.0 : (TIS ? w * wis : w);
  const double g1 = o.clipped ? 0.0 : gpre, g2 = o.clipped ? gpre : 0.0;
  const double gr = g1 * na + ((r >= lo) && (r <= hi) ? g2 * na : 0.0);
  o.lw = l * w;
  o.grad = l != l ? l : gr * r;
  o.ratio = r;
  o.kl = (r - 1.0) - x;
  return o;
}

// The value loss's token in float64, as ppo_token_f64 (eps < 0: no clip): lw = loss * w, grad = d lw / d v.
struct ValueToken64 {
  double lw, grad;
  bool clipped;
};

CRF_HDI ValueToken64 value_token_f64(double v, double old_v, double ret, double eps, double w) {
  ValueToken64 o;
  const double e1 = v - ret, q1 = e1 * e1;
  double l, g;
  o.clipped = false;
  if (eps >= 0.0) {
    const double d = v - old_v;
    const bool inside = fabs(d) <= eps;
    const double vc = inside ? v : old_v + (d < -eps ? -eps : (d > eps ? eps : d));  // NaN d stays NaN
    const double e2 = vc - ret, q2 = e2 * e2;
    o.clipped = q2 > q1;
    const bool take2 = o.clipped | (q2 != q2);
    l = 0.5 * (take2 ? q2 : q1);
    const double gq = w * 0.5;
    g = (take2 ? 0.0 : gq) * (2.0 * e1) + (inside ? (take2 ? gq : 0.0) * (2.0 * e2) : 0.0);
  } else {
    l = 0.5 * q1;
    g = (w * 0.5) * (2.0 * e1);
  }
  o.lw = l * w;
  o.grad = l != l ? l : g;
  return o;
}

// max(a, b) that returns NaN when either is NaN (torch.max semantics; a plain a > b ? a : b drops it).
CRF_HDI float nan_max(float a, float b) { return (a > b) | (a != a) ? a : b; }

}  // namespace crf
