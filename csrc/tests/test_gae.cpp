// C++ checks of segment_gae through the dispatcher and of the shared per-token helpers.
// Built by CMakeLists.txt and run with ctest; the exhaustive tests are the Python ones.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "common/gae_step.h"

namespace crf {
std::string cpu_simd(const char* name);  // csrc/cpu/gae.cpp
}

static int failures = 0;
#define CHECK_NEAR(a, b, tol)                                                                \
  do {                                                                                       \
    double _a = (a), _b = (b);                                                               \
    if (!(std::fabs(_a - _b) <= (tol))) {                                                    \
      std::printf("FAIL %s:%d: %s = %.9g, expected %.9g\n", __FILE__, __LINE__, #a, _a, _b); \
      ++failures;                                                                            \
    }                                                                                        \
  } while (0)

// The one-rollout-at-a-time scan: crf::rollout_params, then crf::gae_step over each recurrence's trainable
// tokens, the plain statement of what the lane-interleaved op computes. Offsets: int64.
static std::tuple<at::Tensor, at::Tensor> serial_gae(const at::Tensor& rew, const at::Tensor& val,
                                                     const at::Tensor& mask, const at::Tensor& cu_seqlens,
                                                     const at::Tensor& cu_segments, double gamma, double lam,
                                                     int64_t lam_mode, double alpha, int64_t cross, double lam_critic) {
  const int64_t *cu = cu_seqlens.data_ptr<int64_t>(), *cs = cu_segments.data_ptr<int64_t>();
  const int64_t S = cu_seqlens.numel() - 1, R = cu_segments.numel() - 1;
  const bool* m = mask.data_ptr<bool>();
  const float *r = rew.data_ptr<float>(), *v = val.data_ptr<float>();
  std::vector<int64_t> counts(S, 0);
  for (int64_t s = 0; s < S; ++s)
    for (int64_t t = cu[s]; t < cu[s + 1]; ++t) counts[s] += m[t];
  std::vector<crf::SegParams> P(S);
  auto adv = torch::zeros_like(rew), ret = torch::zeros_like(rew);
  float *pa = adv.data_ptr<float>(), *pr = ret.data_ptr<float>();
  for (int64_t k = 0; k < R; ++k) {
    crf::rollout_params<int64_t>(cs[k], cs[k + 1], cu, counts.data(), nullptr, gamma, lam, lam_mode, alpha, cross,
                                 lam_critic, P.data());
    crf::GaeCarry c, cc;  // advantage and critic (returns) recurrences
    for (int64_t s = cs[k + 1] - 1; s >= cs[k]; --s) {
      if (P[s].reset != 0.0) c = crf::GaeCarry(), cc = crf::GaeCarry();
      for (int64_t t = cu[s + 1] - 1; t >= cu[s]; --t) {
        if (!m[t]) continue;
        const double a = crf::gae_step(c, r[t], v[t], gamma, P[s].gl);
        pa[t] = (float)(P[s].scale * a);
        pr[t] = (float)((lam_critic >= 0.0 ? crf::gae_step(cc, r[t], v[t], gamma, P[s].glc) : a) + v[t]);
      }
    }
  }
  return {adv, ret};
}

int main() {
  // COMPACTIONRL_FAST_CPU_SIMD is read once, at the first call
  setenv("COMPACTIONRL_FAST_CPU_SIMD", "avx2", 1);
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
  setenv("COMPACTIONRL_FAST_CPU_SIMD", "none", 1);
  if (crf::cpu_simd(nullptr) != "avx2") {
    std::printf("FAIL COMPACTIONRL_FAST_CPU_SIMD not read once: %s\n", crf::cpu_simd(nullptr).c_str());
    ++failures;
  }
  unsetenv("COMPACTIONRL_FAST_CPU_SIMD");
  crf::cpu_simd("auto");

  // the lane-interleaved scan equals the one-rollout-at-a-time scan bitwise: many rollouts of random
  // lengths (lanes refilled, segment ends inside 4-token blocks, a tail of unequal chains), every mode
  torch::manual_seed(0);
  const int64_t S = 37;
  auto lens = torch::randint(0, 300, {S}, torch::kLong);
  auto cu2 = torch::cat({torch::zeros({1}, torch::kLong), lens.cumsum(0)});
  auto cs2 = torch::tensor({0, 1, 5, 6, 13, 20, 21, 30, 37}, torch::kLong);
  const int64_t T = cu2[-1].item<int64_t>();
  auto r2 = torch::randn({T}), v2 = torch::randn({T}), m2 = torch::rand({T}) > 0.3;
  for (int64_t cross : CRF_CROSS_MODES)
    for (double lamc : {-1.0, 1.0}) {
      auto [a1_, r1_] = op.call(r2, v2, m2, cu2, cs2, std::nullopt, 0.99, 0.0, crf::kLamAdaptiveRollout, 1.5, cross,
                                lamc, std::nullopt);
      auto [a2_, r2_] = serial_gae(r2, v2, m2, cu2, cs2, 0.99, 0.0, crf::kLamAdaptiveRollout, 1.5, cross, lamc);
      if (!torch::equal(a1_, a2_) || !torch::equal(r1_, r2_)) {
        std::printf("FAIL lanes != serial (cross %ld, lam_critic %g)\n", (long)cross, lamc);
        ++failures;
      }
    }
  // every SIMD path (crf::cpu_simd; the CPU's best when it lacks one) gives the same bits, on lengths that
  // leave tails after the 8- and 4-token vector steps
  for (int64_t cross : CRF_CROSS_MODES) {
    std::tuple<at::Tensor, at::Tensor> first;
    for (const char* simd : {"auto", "avx2", "none"}) {
      crf::cpu_simd(simd);
      auto out = op.call(r2, v2, m2, cu2, cs2, std::nullopt, 0.97, 0.9, crf::kLamConst, 1.5, cross, 1.0, std::nullopt);
      if (std::strcmp(simd, "auto") == 0) first = out;
      else if (!torch::equal(std::get<0>(out), std::get<0>(first)) || !torch::equal(std::get<1>(out), std::get<1>(first))) {
        std::printf("FAIL cpu_simd %s != auto (cross %ld)\n", simd, (long)cross);
        ++failures;
      }
    }
  }
  crf::cpu_simd("auto");
  if (failures == 0) std::printf("test_gae: all checks passed\n");
  return failures == 0 ? 0 : 1;
}
