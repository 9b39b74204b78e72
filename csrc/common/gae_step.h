// Per-token GAE math shared by the CPU (csrc/cpu/gae.cpp) and CUDA (csrc/cuda/gae.cu) kernels.
#pragma once
#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define CRF_HD __host__ __device__ __forceinline__
#else
#define CRF_HD inline
#endif

namespace crf {

// How lambda is chosen per segment.
enum LamMode : int64_t { kLamConst = 0, kLamAdaptiveSegment = 1, kLamAdaptiveRollout = 2, kLamTensor = 3 };
// How segments of one rollout interact.
enum CrossMode : int64_t { kCrossNone = 0, kCrossPaper = 1, kCrossStitched = 2 };

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

}  // namespace crf
