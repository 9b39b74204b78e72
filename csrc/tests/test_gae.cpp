// C++ checks of segment_gae through the dispatcher and of the shared per-token helpers.
// Built by CMakeLists.txt and run with ctest; the exhaustive tests are the Python ones.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/gae_step.h"

static int failures = 0;
#define CHECK_NEAR(a, b, tol)                                                                \
  do {                                                                                       \
    double _a = (a), _b = (b);                                                               \
    if (!(std::fabs(_a - _b) <= (tol))) {                                                    \
      std::printf("FAIL %s:%d: %s = %.9g, expected %.9g\n", __FILE__, __LINE__, #a, _a, _b); \
      ++failures;                                                                            \
    }                                                                                        \
  } while (0)

int main() {
  // helpers
  CHECK_NEAR(crf::power_count(0.0, 0), 1.0, 0);
  CHECK_NEAR(crf::power_count(0.0, 5), 0.0, 0);
  CHECK_NEAR(crf::power_count(0.5, 3), 0.125, 1e-15);
  CHECK_NEAR(crf::power_count(0.999, 1000000), std::exp(1000000 * std::log(0.999)), 1e-300);
  CHECK_NEAR(crf::adaptive_lambda(0, 1.5), 1.0 - 1.0 / 1.5, 1e-15);
  CHECK_NEAR(crf::adaptive_lambda(1, 0.5), 0.0, 0);

  // one rollout, two segments of two trainable tokens, gamma 0.9, lam 0.5, "paper" mode
  auto op = c10::Dispatcher::singleton()
                .findSchemaOrThrow("compactionrl_fast::segment_gae", "")
                .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                          const at::Tensor&, const at::Tensor&,
                                                          const std::optional<at::Tensor>&, double, double, int64_t,
                                                          double, int64_t, double, const std::optional<at::Tensor>&)>();
  auto r = torch::tensor({0.f, 1.f, 0.f, 1.f});
  auto v = torch::tensor({0.1f, 0.2f, 0.3f, 0.4f});
  auto m = torch::ones({4}, torch::kBool);
  auto cu = torch::tensor({0, 2, 4}, torch::kInt32), cs = torch::tensor({0, 2}, torch::kInt32);
  const double g = 0.9, l = 0.5, gl = g * l;
  auto [adv, ret] = op.call(r, v, m, cu, cs, std::nullopt, g, l, crf::kLamConst, 1.5, crf::kCrossPaper, -1.0,
                            std::nullopt);
  const double a4 = 1 - 0.4, a3 = g * 0.4 - 0.3 + gl * a4, a2 = 1 - 0.2, a1 = g * 0.2 - 0.1 + gl * a2;
  CHECK_NEAR(adv[0].item<float>(), a1 * gl * gl, 1e-6);
  CHECK_NEAR(adv[1].item<float>(), a2 * gl * gl, 1e-6);
  CHECK_NEAR(adv[2].item<float>(), a3, 1e-6);
  CHECK_NEAR(adv[3].item<float>(), a4, 1e-6);
  CHECK_NEAR(ret[0].item<float>(), a1 + 0.1, 1e-6);

  // the lane-interleaved scan equals the one-rollout-at-a-time scan bitwise: many rollouts of random
  // lengths (lanes refilled, segment ends inside 4-token blocks, a tail of unequal chains), every mode
  auto serial = c10::Dispatcher::singleton()
                    .findSchemaOrThrow("compactionrl_fast::segment_gae_serial", "")
                    .typed<std::tuple<at::Tensor, at::Tensor>(
                        const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const std::optional<at::Tensor>&, double, double, int64_t, double, int64_t, double,
                        const std::optional<at::Tensor>&)>();
  torch::manual_seed(0);
  const int64_t S = 37;
  auto lens = torch::randint(0, 300, {S}, torch::kLong);
  auto cu2 = torch::cat({torch::zeros({1}, torch::kLong), lens.cumsum(0)});
  auto cs2 = torch::tensor({0, 1, 5, 6, 13, 20, 21, 30, 37}, torch::kLong);
  const int64_t T = cu2[-1].item<int64_t>();
  auto r2 = torch::randn({T}), v2 = torch::randn({T}), m2 = torch::rand({T}) > 0.3;
  for (int64_t cross : {crf::kCrossNone, crf::kCrossPaper, crf::kCrossStitched})
    for (double lamc : {-1.0, 1.0}) {
      auto [a1_, r1_] = op.call(r2, v2, m2, cu2, cs2, std::nullopt, 0.99, 0.0, crf::kLamAdaptiveRollout, 1.5, cross,
                                lamc, std::nullopt);
      auto [a2_, r2_] = serial.call(r2, v2, m2, cu2, cs2, std::nullopt, 0.99, 0.0, crf::kLamAdaptiveRollout, 1.5,
                                    cross, lamc, std::nullopt);
      if (!torch::equal(a1_, a2_) || !torch::equal(r1_, r2_)) {
        std::printf("FAIL lanes != serial (cross %ld, lam_critic %g)\n", (long)cross, lamc);
        ++failures;
      }
    }
  // every SIMD path (COMPACTIONRL_FAST_CPU_SIMD; the CPU's best when it lacks one) gives the same bits, on
  // lengths that leave tails after the 8- and 4-token vector steps
  for (int64_t cross : {crf::kCrossNone, crf::kCrossPaper, crf::kCrossStitched}) {
    std::tuple<at::Tensor, at::Tensor> first;
    for (const char* simd : {"auto", "avx2", "none"}) {
      setenv("COMPACTIONRL_FAST_CPU_SIMD", simd, 1);
      auto out = op.call(r2, v2, m2, cu2, cs2, std::nullopt, 0.97, 0.9, crf::kLamConst, 1.5, cross, 1.0, std::nullopt);
      if (std::strcmp(simd, "auto") == 0) first = out;
      else if (!torch::equal(std::get<0>(out), std::get<0>(first)) || !torch::equal(std::get<1>(out), std::get<1>(first))) {
        std::printf("FAIL COMPACTIONRL_FAST_CPU_SIMD=%s != auto (cross %ld)\n", simd, (long)cross);
        ++failures;
      }
    }
  }
  unsetenv("COMPACTIONRL_FAST_CPU_SIMD");
  if (failures == 0) std::printf("test_gae: all checks passed\n");
  return failures == 0 ? 0 : 1;
}
