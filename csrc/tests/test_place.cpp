// C++ checks of place_final_rewards (csrc/cpu/place.cpp) through the dispatcher. Built by CMakeLists.txt and
// run with ctest; the exhaustive tests are the Python ones (tests/ops/test_place.py).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

#include <cstdio>
#include <vector>

#include "expect.h"

// The placement stated token by token: each segment's (or rollout's) last trainable token gets the reward.
static at::Tensor serial_place(const at::Tensor& rr, const at::Tensor& mask, const at::Tensor& cu_seqlens,
                               const at::Tensor& cu_segments, bool stitched) {
  const int64_t *cu = cu_seqlens.data_ptr<int64_t>(), *cs = cu_segments.data_ptr<int64_t>();
  const bool* m = mask.data_ptr<bool>();
  auto out = torch::zeros({mask.numel()});
  for (int64_t r = 0; r + 1 < cu_segments.numel(); ++r) {
    int64_t last = -1;
    for (int64_t s = cs[r]; s < cs[r + 1]; ++s) {
      int64_t seg_last = -1;
      for (int64_t t = cu[s]; t < cu[s + 1]; ++t)
        if (m[t]) seg_last = t;
      if (seg_last >= 0 && !stitched) out[seg_last] = rr[r];
      if (seg_last >= 0) last = seg_last;
    }
    if (last >= 0 && stitched) out[last] = rr[r];
  }
  return out;
}

int main() {
  auto op = c10::Dispatcher::singleton()
                .findSchemaOrThrow("compactionrl_fast::place_final_rewards", "")
                .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, bool)>();
  // docs/layout.md's example: rollout 0 = segments 0-1, rollout 1 = segment 2
  auto m = torch::tensor({0, 1, 1, 1, 0, 1, 1, 0, 1, 1}, torch::kBool);
  auto cu = torch::tensor({0, 4, 7, 10}, torch::kInt32), cs = torch::tensor({0, 2, 3}, torch::kInt32);
  auto rr = torch::tensor({2.f, 5.f});
  EXPECT(torch::equal(op.call(rr, m, cu, cs, false), torch::tensor({0.f, 0.f, 0.f, 2.f, 0.f, 0.f, 2.f, 0.f, 0.f, 5.f})));
  EXPECT(torch::equal(op.call(rr, m, cu, cs, true), torch::tensor({0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 2.f, 0.f, 0.f, 5.f})));

  // random layouts: empty segments and rollouts, untrainable segments, both index dtypes, both modes
  torch::manual_seed(0);
  for (int trial = 0; trial < 20; ++trial) {
    const int64_t S = 1 + trial * 3, R = 1 + trial;
    auto lens = torch::randint(0, 200, {S}, torch::kLong);
    auto cu2 = torch::cat({torch::zeros({1}, torch::kLong), lens.cumsum(0)});
    auto cuts = std::get<0>(torch::randint(0, S + 1, {R - 1}, torch::kLong).sort());
    auto cs2 = torch::cat({torch::zeros({1}, torch::kLong), cuts, torch::full({1}, S, torch::kLong)});
    const int64_t T = cu2[-1].item<int64_t>();
    auto m2 = torch::rand({T}) > (trial % 3 == 0 ? 0.97 : 0.4);
    auto rr2 = torch::randn({R}) + 3.0;
    for (bool stitched : {false, true}) {
      auto want = serial_place(rr2, m2, cu2, cs2, stitched);
      EXPECT(torch::equal(op.call(rr2, m2, cu2, cs2, stitched), want));
      EXPECT(torch::equal(op.call(rr2.to(torch::kDouble), m2, cu2.to(torch::kInt32), cs2.to(torch::kInt32), stitched),
                         want));
    }
  }

  // bad offsets are refused (the op indexes with them)
  for (auto bad : {std::vector<int64_t>{0, 7, 4, 10}, std::vector<int64_t>{0, 4, 7, 11}, std::vector<int64_t>{1, 4, 7, 10}}) {
    bool threw = false;
    try {
      op.call(rr, m, torch::tensor(bad, torch::kLong), torch::tensor({0, 2, 3}, torch::kLong), false);
    } catch (const c10::ValueError&) {
      threw = true;
    }
    EXPECT(threw);
  }
  if (failures == 0) std::printf("test_place: all checks passed\n");
  return failures == 0 ? 0 : 1;
}
