// place_final_rewards on CPU. Schema: csrc/schemas.cpp; Python semantics and validation:
// compactionrl_fast/ops/gae.py. Per rollout (in parallel): its tokens zeroed, then one backward search per
// segment from the segment's end to its last trainable token (memrchr), the rollout's reward stored there;
// "stitched" stops at the first segment (from the end) that has one. O(S) searches, each stopping at the
// first trainable byte from the end, plus one memset over [T].
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cstring>

#include "../common/alloc.h"
#include "../common/place_inputs.h"
#include "segment_runs.h"

namespace {

// The last p in [b, e) with mask[p] (mask bytes are 0 or 1), or -1.
inline int64_t last_true(const uint8_t* m, int64_t b, int64_t e) {
  if (e <= b) return -1;
  const void* p = memrchr(m + b, 1, (size_t)(e - b));
  return p == nullptr ? -1 : (int64_t)(static_cast<const uint8_t*>(p) - m);
}

at::Tensor place_final_rewards_cpu(const at::Tensor& rollout_rewards, const at::Tensor& loss_mask,
                                   const at::Tensor& cu_seqlens, const at::Tensor& cu_segments, bool stitched) {
  TORCH_CHECK(loss_mask.device().is_cpu(), "place_final_rewards: all tensors must be on the CPU");
  crf::check_place_inputs(rollout_rewards, loss_mask, cu_seqlens, cu_segments);
  const auto idx = cu_seqlens.scalar_type();
  auto mask = loss_mask.contiguous(), cs = cu_seqlens.contiguous(), cg = cu_segments.contiguous();
  auto rr = rollout_rewards.to(at::kFloat).contiguous();
  const int64_t T = mask.numel(), S = cs.numel() - 1, R = cg.numel() - 1;
  // the loop indexes loss_mask and the output with the offsets: checked here too (O(S + R)), since the op can be
  // called without the Python checks; a bad layout is a ValueError, never an out-of-bounds access
  crf::check_offsets_host("place_final_rewards", cs, T);
  if (idx == at::kInt)
    crf::check_offsets_host("place_final_rewards (cu_segments)", cg.data_ptr<int32_t>(), R, S);
  else
    crf::check_offsets_host("place_final_rewards (cu_segments)", cg.data_ptr<int64_t>(), R, S);
  at::Tensor out = crf::empty_output({T}, rr.options());
  const uint8_t* pm = reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>());
  const float* prr = rr.data_ptr<float>();
  float* po = out.data_ptr<float>();
  // ~32K tokens per task, as segment_gae: a small batch stays on the calling thread
  const int64_t grain = std::max<int64_t>(1, R * 32768 / std::max<int64_t>(T, 1));
  AT_DISPATCH_INDEX_TYPES(idx, "place_final_rewards_cpu", [&] {
    const index_t* cu = cs.data_ptr<index_t>();
    const index_t* seg = cg.data_ptr<index_t>();
    at::parallel_for(0, R, grain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t s0 = seg[r], s1 = seg[r + 1];
        std::memset(po + cu[s0], 0, sizeof(float) * (size_t)(cu[s1] - cu[s0]));  // rollouts tile [0, T)
        for (int64_t s = s1 - 1; s >= s0; --s) {
          const int64_t p = last_true(pm, cu[s], cu[s + 1]);
          if (p < 0) continue;
          po[p] = prr[r];
          if (stitched) break;
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(compactionrl_fast, CPU, m) { m.impl("place_final_rewards", &place_final_rewards_cpu); }
