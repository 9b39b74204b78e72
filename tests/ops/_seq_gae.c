// Sequential GAE per segment (cross-segment "none", constant lambda; the returns are adv + V): the loop
// trainers run, in float32 and in float64, for the accuracy rule of tests/ops/test_gae_accuracy.py.
// Built with -ffp-contract=off so that each step rounds as the plain loop does.
#include <stdint.h>

#define SCAN(T, NAME)                                                                                       \
  void NAME(const float* r, const float* v, const uint8_t* m, const int64_t* cu, int64_t S, double gamma,  \
            double lam, T* adv) {                                                                           \
    for (int64_t s = 0; s < S; ++s) {                                                                       \
      T a = 0, vn = 0;                                                                                      \
      for (int64_t t = cu[s + 1] - 1; t >= cu[s]; --t) {                                                    \
        if (!m[t]) {                                                                                        \
          adv[t] = 0;                                                                                       \
          continue;                                                                                         \
        }                                                                                                   \
        a = (T)r[t] + (T)gamma * vn - (T)v[t] + (T)(gamma * lam) * a;                                       \
        vn = (T)v[t];                                                                                       \
        adv[t] = a;                                                                                         \
      }                                                                                                     \
    }                                                                                                       \
  }

SCAN(float, scan_f32)
SCAN(double, scan_f64)
