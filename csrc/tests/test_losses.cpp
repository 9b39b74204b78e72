// C++ checks of the CPU loss kernels through the dispatcher, at sizes above their thresholds: several
// 8,192-token blocks (segments across block boundaries, an empty segment on a boundary), results equal
// for 1, 2 and 3 threads (the block partials are added in block order), and bad offsets rejected on the
// host with a ValueError naming cu_seqlens. The exhaustive tests are the Python ones (tests/ops/).
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "common/ppo_math.h"

#include "expect.h"

using Out = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

static auto ppo_op() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("compactionrl_fast::ppo_policy_loss", "")
      .typed<Out(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                 const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, const at::Tensor&, double,
                 double, double, double, bool)>();
}

static auto value_op() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("compactionrl_fast::value_loss", "")
      .typed<Out(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                 const std::optional<at::Tensor>&, const at::Tensor&, double, bool)>();
}

// Segments of 9000, 7000 (crossing the 8192 and 16384 block ends), 3, 0 (on no boundary), 5000 and
// 1193 tokens: T = 22196, 3 blocks, 2 tasks for 2 threads.
static const std::vector<int64_t> kLengths = {9000, 7000, 3, 0, 5000, 1193};

int main() {
  std::vector<int64_t> cu_v = {0};
  for (int64_t n : kLengths) cu_v.push_back(cu_v.back() + n);
  const int64_t T = cu_v.back(), S = (int64_t)kLengths.size();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  auto old = torch::randn({T}, gen) - 2.0;
  auto logp = old + torch::randn({T}, gen) * 0.6;
  auto adv = torch::randn({T}, gen);
  auto mask = torch::rand({T}, gen) < 0.8;
  auto cu = torch::tensor(cu_v, torch::kInt64);
  auto scale = torch::rand({S}, gen).to(torch::kDouble) + 0.5;

  // the per-token loss and gradient, and the weighted sum, token by token without blocks
  const double lo = 0.8, hi = 1.2, dual = 3.0;
  double want = 0.0;
  std::vector<float> want_grad(T);
  const float* lp = logp.data_ptr<float>();
  const float* op = old.data_ptr<float>();
  const float* ap = adv.data_ptr<float>();
  const bool* mp = mask.data_ptr<bool>();
  for (int64_t s = 0; s < S; ++s) {
    const double w = scale[s].item<double>();
    for (int64_t t = cu_v[s]; t < cu_v[s + 1]; ++t) {
      const crf::PpoToken o = crf::ppo_token(lp[t] - op[t], ap[t], (float)lo, (float)hi, (float)dual);
      want += mp[t] ? w * o.loss : 0.0;
      want_grad[t] = mp[t] ? (float)(o.dlogp * (float)w) : 0.0f;
    }
  }

  auto ppo = ppo_op();
  std::vector<Out> runs;
  for (int threads : {1, 2, 3}) {
    at::set_num_threads(threads);
    runs.push_back(ppo.call(logp, old, adv, mask, std::nullopt, cu, scale, 0.2, 0.2, dual, 1e30, true));
  }
  const auto& [loss, metrics, grad] = runs[0];
  EXPECT(std::fabs(loss.item<double>() - want) <= 1e-5 * std::fabs(want) + 1e-6);
  int64_t bad_grad = 0;
  // within float32 rounding (the kernel's AVX2+FMA copy may contract the exp polynomial differently)
  const float* gp = grad.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) bad_grad += !(std::fabs(gp[t] - want_grad[t]) <= 1e-6f * std::fabs(want_grad[t]));
  EXPECT(bad_grad == 0);
  for (size_t i = 1; i < runs.size(); ++i) {
    EXPECT(torch::equal(std::get<0>(runs[i]), loss));
    EXPECT(torch::equal(std::get<1>(runs[i]), metrics));
    EXPECT(torch::equal(std::get<2>(runs[i]), grad));
  }

  // value_loss: same layout, thread counts, the unclipped loss is 0.5 (v - R)^2 per token
  auto vals = torch::randn({T}, gen), rets = torch::randn({T}, gen);
  double want_v = 0.0;
  for (int64_t s = 0; s < S; ++s) {
    const double w = scale[s].item<double>();
    for (int64_t t = cu_v[s]; t < cu_v[s + 1]; ++t) {
      const double e = (double)vals[t].item<float>() - (double)rets[t].item<float>();
      want_v += mp[t] ? w * 0.5 * e * e : 0.0;
    }
  }
  auto vop = value_op();
  std::vector<Out> vruns;
  for (int threads : {1, 2, 3}) {
    at::set_num_threads(threads);
    vruns.push_back(vop.call(vals, vals, rets, mask, cu, scale, -1.0, true));
  }
  EXPECT(std::fabs(std::get<0>(vruns[0]).item<double>() - want_v) <= 1e-5 * std::fabs(want_v));
  for (size_t i = 1; i < vruns.size(); ++i) {
    EXPECT(torch::equal(std::get<0>(vruns[i]), std::get<0>(vruns[0])));
    EXPECT(torch::equal(std::get<1>(vruns[i]), std::get<1>(vruns[0])));
    EXPECT(torch::equal(std::get<2>(vruns[i]), std::get<2>(vruns[0])));
  }

  // bad offsets: a ValueError naming cu_seqlens, never a crash
  const std::vector<std::vector<int64_t>> bad = {{0, 4, int64_t(1) << 40, 10}, {0, 7, 4, 10}, {0, 4, 7, int64_t(1) << 30},
                                                 {5, 4, 7, 10}, {0, 4, 7, 8}};
  auto t10 = torch::zeros({10}), m10 = torch::ones({10}, torch::kBool);
  auto s3 = torch::ones({3}, torch::kDouble);
  for (const auto& b : bad) {
    auto c = torch::tensor(b, torch::kInt64);
    for (int which = 0; which < 2; ++which) {
      bool raised = false;
      try {
        if (which == 0)
          ppo.call(t10, t10, t10, m10, std::nullopt, c, s3, 0.2, 0.2, 3.0, 1e30, true);
        else
          vop.call(t10, t10, t10, m10, c, s3, 0.2, true);
      } catch (const c10::ValueError& e) {
        raised = std::string(e.what()).find("cu_seqlens") != std::string::npos;
      }
      EXPECT(raised);
    }
  }

  if (failures == 0) std::printf("test_losses: all checks passed\n");
  return failures == 0 ? 0 : 1;
}
