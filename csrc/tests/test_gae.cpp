// C++ checks of segment_gae through the dispatcher and of the shared per-token helpers.
// Built by CMakeLists.txt and run with ctest; the exhaustive tests are the Python ones.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>

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
                                                          double, int64_t, double)>();
  auto r = torch::tensor({0.f, 1.f, 0.f, 1.f});
  auto v = torch::tensor({0.1f, 0.2f, 0.3f, 0.4f});
  auto m = torch::ones({4}, torch::kBool);
  auto cu = torch::tensor({0, 2, 4}, torch::kInt32), cs = torch::tensor({0, 2}, torch::kInt32);
  const double g = 0.9, l = 0.5, gl = g * l;
  auto [adv, ret] = op.call(r, v, m, cu, cs, std::nullopt, g, l, crf::kLamConst, 1.5, crf::kCrossPaper, -1.0);
  const double a4 = 1 - 0.4, a3 = g * 0.4 - 0.3 + gl * a4, a2 = 1 - 0.2, a1 = g * 0.2 - 0.1 + gl * a2;
  CHECK_NEAR(adv[0].item<float>(), a1 * gl * gl, 1e-6);
  CHECK_NEAR(adv[1].item<float>(), a2 * gl * gl, 1e-6);
  CHECK_NEAR(adv[2].item<float>(), a3, 1e-6);
  CHECK_NEAR(adv[3].item<float>(), a4, 1e-6);
  CHECK_NEAR(ret[0].item<float>(), a1 + 0.1, 1e-6);
  if (failures == 0) std::printf("test_gae: all checks passed\n");
  return failures == 0 ? 0 : 1;
}
