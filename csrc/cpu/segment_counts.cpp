// segment_counts on CPU: trainable tokens of each segment, int64 [S], without any [T] temporary.
// Used by the loss reductions (compactionrl_fast/ops/_reduction.py) for "segment-mean"/"rollout-mean".
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include "../common/count.h"
#include "segment_runs.h"

namespace {

at::Tensor segment_counts_cpu(const at::Tensor& loss_mask, const at::Tensor& cu_seqlens) {
  TORCH_CHECK(loss_mask.scalar_type() == at::kBool && loss_mask.dim() == 1,
              "segment_counts: loss_mask must be a bool [T] tensor");
  auto mask = loss_mask.contiguous();
  auto cs = cu_seqlens.contiguous();
  const int64_t S = cs.numel() - 1;
  TORCH_CHECK_VALUE(S >= 0, "segment_counts: cu_seqlens must have at least one element");
  TORCH_CHECK_VALUE(cs.scalar_type() == at::kInt || cs.scalar_type() == at::kLong,
                    "segment_counts: cu_seqlens must be an int32/int64 tensor");
  // the loop below indexes loss_mask with the offsets: check them (O(S) on the host, no sync on CPU)
  crf::check_offsets_host("segment_counts", cs, mask.numel());
  at::Tensor out = at::empty({S}, cs.options().dtype(at::kLong));
  const uint8_t* pm = reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>());
  int64_t* po = out.data_ptr<int64_t>();
  AT_DISPATCH_INDEX_TYPES(cs.scalar_type(), "segment_counts_cpu", [&] {
    const index_t* cu = cs.data_ptr<index_t>();
    at::parallel_for(0, S, 256, [&](int64_t s0, int64_t s1) {
      for (int64_t s = s0; s < s1; ++s) po[s] = crf::count_true(pm, cu[s], cu[s + 1]);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(compactionrl_fast, CPU, m) { m.impl("segment_counts", &segment_counts_cpu); }
