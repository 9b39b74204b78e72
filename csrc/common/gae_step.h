// Per-token GAE math shared by the CPU (csrc/cpu/gae.cpp) and CUDA (csrc/cuda/gae.cu) kernels.
#pragma once
#include <cmath>
#include <cstdint>

#include "modes.h"

#if defined(__CUDACC__)
#define CRF_HD __host__ __device__ __forceinline__
#else
#define CRF_HD inline
#endif

namespace crf {

// lam = 1 - 1/(alpha * l), l >= 1, clamped to [0, 1].
CRF_HD double adaptive_lambda(int64_t length, double alpha) {
  double l = length < 1 ? 1.0 : (double)length;
  double lam = 1.0 - 1.0 / (alpha * l);
  return lam < 0.0 ? 0.0 : (lam > 1.0 ? 1.0 : lam);
}

// base^n for base in [0, 1] and n up to 2^63 without overflow or NaN; 0^0 = 1.
CRF_HD double power_count(double base, int64_t n) {
  if (n == 0) return 1.0;
  if (base <= 0.0) return 0.0;
  return exp((double)n * log(base));
}

// Per-segment numbers every scan reads; `rollout_params` is the one place (for C++ and CUDA) that turns the
// lambda and cross-segment modes (csrc/common/modes.h) into them (the Triton port: kernels/gae_params.py).
struct SegParams {
  double gl, glc, scale, reset;  // gamma*lam, gamma*lam_critic, adv scale, 1 if nothing flows in from after s
};

// Whether rollout_params reads the segments' trainable-token counts (the modes say: kernels/modes.py).
CRF_HD bool needs_counts(int64_t lam_mode, int64_t cross) { return CRF_NEEDS_COUNTS(lam_mode, cross); }

// SegParams of the segments [s0, s1) of one rollout. counts[s]: trainable tokens of segment s (may be null
// when neither adaptive lambda nor the paper's scale needs it); cu: token offsets [S+1]; lam_seg: [S] or null.
template <typename idx_t>
CRF_HD void rollout_params(int64_t s0, int64_t s1, const idx_t* cu, const int64_t* counts, const float* lam_seg,
                           double gamma, double lam, int64_t lam_mode, double alpha, int64_t cross,
                           double lam_critic, SegParams* out) {
  int64_t n_rollout = 0;
  if (lam_mode == kLamAdaptiveRollout)
    for (int64_t s = s0; s < s1; ++s) n_rollout += counts[s];
  int64_t n_later = 0;  // trainable tokens in later segments of this rollout
  for (int64_t s = s1 - 1; s >= s0; --s) {
    double l;
    switch (lam_mode) {
      case kLamConst: l = lam; break;
      case kLamTensor: l = lam_seg[s]; break;
      case kLamAdaptiveRollout: l = adaptive_lambda(n_rollout, alpha); break;
      default: l = adaptive_lambda(counts[s], alpha);
    }
    SegParams o;
    o.gl = gamma * l;
    o.glc = lam_critic >= 0.0 ? gamma * lam_critic : o.gl;
    o.scale = cross == kCrossPaper ? power_count(o.gl, n_later) : 1.0;
    // stitched: the recurrence runs on into the next segment unless no token of the rollout follows
    o.reset = (cross != kCrossStitched || cu[s + 1] == cu[s1]) ? 1.0 : 0.0;
    out[s] = o;
    if (counts) n_later += counts[s];
  }
}

// Recurrence state carried backwards over trainable tokens: the next trainable token's value and
// advantage (0 past the end).
struct GaeCarry {
  double v_next = 0.0;
  double a_next = 0.0;
};

// One reverse step at a trainable token: returns A_k and advances the carry.
CRF_HD double gae_step(GaeCarry& c, double r, double v, double gamma, double gamma_lam) {
  double a = r + gamma * c.v_next - v + gamma_lam * c.a_next;
  c.a_next = a;
  c.v_next = v;
  return a;
}

// ---- Carry maps (the CUDA kernels split a recurrence into pieces, csrc/cuda/gae_kernels.cuh) ----
// The state carried backwards: A and V of the nearest later trainable token, and A of the returns'
// recurrence (same V). A token range acts on it as an affine map; maps of adjacent ranges compose.
// Plain aggregates (CUDA __shared__ arrays need trivial constructors): GaeState{} is the zero state.
struct GaeState {
  double a, v, ac;
};

// state' = M(state):  a' = xa*a + ya*v + pa,  v' = z*v + q,  ac' = xc*ac + yc*v + pc.  z is 1 for the
// identity (no token) and 0 once a token replaced v; stop = 1 once the recurrence stopped inside the range
// (the state is then ignored). Those two cases are selects, never products with 0: the sequential
// recurrence (and the reference) never multiplies a replaced or reset state, so a NaN or inf there must
// not turn into NaN through 0 * inf. The other products are the recurrence's own (gamma*lam times A).
struct GaeMap {
  double xa, ya, pa, z, q, xc, yc, pc, stop;
};

CRF_HD GaeMap identity_map() { return GaeMap{1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0}; }

CRF_HD GaeState apply(const GaeMap& m, const GaeState& s) {
  if (m.z != 0.0) return s;  // the identity
  if (m.stop != 0.0) return GaeState{m.pa, m.q, m.pc};
  GaeState o;
  o.a = m.xa * s.a + m.ya * s.v + m.pa;
  o.v = m.q;
  o.ac = m.xc * s.ac + m.yc * s.v + m.pc;
  return o;
}

// The map of `earlier` applied after `later` (later tokens act first: the recurrence runs backwards).
CRF_HD GaeMap then(const GaeMap& later, const GaeMap& e) {
  if (e.z != 0.0) return later;  // e is the identity
  if (later.z != 0.0 || e.stop != 0.0) return e;
  GaeMap o;
  o.xa = e.xa * later.xa;
  o.ya = e.xa * later.ya;  // + e.ya * later.z, which is 0
  o.pa = e.xa * later.pa + e.ya * later.q + e.pa;
  o.z = 0.0;
  o.q = e.q;
  o.xc = e.xc * later.xc;
  o.yc = e.xc * later.yc;
  o.pc = e.xc * later.pc + e.yc * later.q + e.pc;
  o.stop = later.stop;
  return o;
}

// m <- (trainable token) after m: the token's map is gae_step's, a' = (r - v) + gamma*v_next + gamma_lam*a_next.
CRF_HD void push_token(GaeMap& m, double r, double v, double gamma, double gamma_lam, double gamma_lam_critic) {
  const GaeMap t{gamma_lam, gamma, r - v, 0.0, v, gamma_lam_critic, gamma, r - v, 0.0};
  m = then(m, t);
}

// m <- (the recurrence stops here) after m: nothing flows past this point.
CRF_HD void push_reset(GaeMap& m) { m = GaeMap{0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0}; }

}  // namespace crf
