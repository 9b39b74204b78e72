// segment_gae on CPU: one reverse pass per rollout, rollouts in parallel, double accumulation.
// Schema and Python-facing semantics: compactionrl_fast/ops/gae.py; math: csrc/common/gae_step.h.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "../common/alloc.h"
#include "../common/gae_step.h"

namespace {

using crf::GaeCarry;
using crf::SegParams;

// One rollout, segments [s0, s1): its per-segment numbers (crf::rollout_params, the counts first when a
// mode needs them), then one reverse pass that reads only those numbers. Segment s holds the tokens
// [b, b + len) with len = cu_seq[s+1] - cu_seq[s] and b = start[s] (segments placed anywhere, e.g. the rows
// of a padded batch), or b = cu_seq[s] when start is null (packed).
template <typename idx_t>
void gae_rollout(int64_t r, const idx_t* cu_seq, const idx_t* cu_seg, const int64_t* start, const float* rew,
                 const float* val, const bool* mask, const float* lam_seg, double gamma, double lam,
                 int64_t lam_mode, double alpha, int64_t cross, double lam_critic, int64_t* counts,
                 SegParams* params, float* adv, float* ret) {
  const int64_t s0 = cu_seg[r], s1 = cu_seg[r + 1];
  auto first = [&](int64_t s) -> int64_t { return start ? start[s] : (int64_t)cu_seq[s]; };
  const bool need_counts = cross == crf::kCrossPaper || lam_mode == crf::kLamAdaptiveSegment ||
                           lam_mode == crf::kLamAdaptiveRollout;
  if (need_counts)
    for (int64_t s = s0; s < s1; ++s) {
      int64_t n = 0;
      for (int64_t t = first(s), e = t + (cu_seq[s + 1] - cu_seq[s]); t < e; ++t) n += mask[t];
      counts[s] = n;
    }
  crf::rollout_params<idx_t>(s0, s1, cu_seq, need_counts ? counts : nullptr, lam_seg, gamma, lam, lam_mode, alpha,
                             cross, lam_critic, params);
  const bool own_critic = lam_critic >= 0.0;
  GaeCarry c, cc;  // advantage and critic (returns) recurrences
  for (int64_t s = s1 - 1; s >= s0; --s) {
    const SegParams sp = params[s];
    if (sp.reset != 0.0) c = GaeCarry(), cc = GaeCarry();
    const int64_t b = first(s);
    for (int64_t t = b + (cu_seq[s + 1] - cu_seq[s]) - 1; t >= b; --t) {
      if (!mask[t]) {
        adv[t] = 0.f;
        ret[t] = 0.f;
        continue;
      }
      const double rt = rew[t], vt = val[t];
      const double a = crf::gae_step(c, rt, vt, gamma, sp.gl);
      adv[t] = (float)(sp.scale * a);
      ret[t] = (float)((own_critic ? crf::gae_step(cc, rt, vt, gamma, sp.glc) : a) + vt);
    }
  }
}

// Offsets are checked here too (O(S + R)), since the op can be called without the Python checks (directly,
// or under torch.compile): a bad layout is a ValueError, never an out-of-bounds access.
template <typename idx_t>
void check_offsets(const idx_t* cu, int64_t n, int64_t total, const char* name, const char* total_name) {
  TORCH_CHECK_VALUE(n >= 1 && cu[0] == 0, "segment_gae: ", name, "[0] must be 0");
  for (int64_t i = 1; i < n; ++i)
    TORCH_CHECK_VALUE(cu[i] >= cu[i - 1], "segment_gae: ", name, " must be non-decreasing, but ", name, "[", i,
                      "]=", (int64_t)cu[i], " < ", name, "[", i - 1, "]=", (int64_t)cu[i - 1]);
  TORCH_CHECK_VALUE(cu[n - 1] == total, "segment_gae: ", name, "[-1] must equal ", total_name, "=", total, ", got ",
                    (int64_t)cu[n - 1]);
}

// Placed segments must tile [0, T): each [start, start + len) inside it, no two overlapping, none left out.
template <typename idx_t>
void check_starts(const int64_t* start, const idx_t* cu, int64_t S, int64_t T) {
  std::vector<std::pair<int64_t, int64_t>> iv(S);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t len = cu[s + 1] - cu[s];
    TORCH_CHECK_VALUE(start[s] >= 0 && start[s] <= T - len, "segment_gae: seg_start[", s, "]=", start[s],
                      " puts segment ", s, " (", len, " tokens) outside [0, T=", T, ")");
    iv[s] = {start[s], len};
  }
  std::sort(iv.begin(), iv.end());
  int64_t next = 0;
  for (const auto& [b, len] : iv) {
    if (len == 0) continue;
    TORCH_CHECK_VALUE(b == next, "segment_gae: the segments placed by seg_start must cover [0, T) without gaps or "
                      "overlaps; position ", std::min(b, next), " is ", b > next ? "in no segment" : "in two");
    next = b + len;
  }
  TORCH_CHECK_VALUE(next == T, "segment_gae: the segments placed by seg_start leave [", next, ", ", T, ") uncovered");
}

std::tuple<at::Tensor, at::Tensor> segment_gae_cpu(const at::Tensor& rewards, const at::Tensor& values,
                                                   const at::Tensor& loss_mask, const at::Tensor& cu_seqlens,
                                                   const at::Tensor& cu_segments,
                                                   const std::optional<at::Tensor>& lam_seg, double gamma,
                                                   double lam, int64_t lam_mode, double alpha, int64_t cross,
                                                   double lam_critic, const std::optional<at::Tensor>& seg_start) {
  TORCH_CHECK(rewards.device().is_cpu() && values.device().is_cpu() && loss_mask.device().is_cpu() &&
                  cu_seqlens.device().is_cpu() && cu_segments.device().is_cpu(),
              "segment_gae: all tensors must be on the CPU");
  TORCH_CHECK(rewards.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat,
              "segment_gae: rewards and values must be float32");
  TORCH_CHECK(loss_mask.scalar_type() == at::kBool, "segment_gae: loss_mask must be bool");
  TORCH_CHECK(cu_seqlens.scalar_type() == cu_segments.scalar_type(),
              "segment_gae: cu_seqlens and cu_segments must share a dtype");
  auto rew = rewards.contiguous(), val = values.contiguous(), mask = loss_mask.contiguous();
  auto cs = cu_seqlens.contiguous(), cg = cu_segments.contiguous();
  at::Tensor ls;
  const float* lam_ptr = nullptr;
  if (lam_mode == crf::kLamTensor) {
    TORCH_CHECK(lam_seg.has_value(), "segment_gae: lam_mode=tensor needs lam_seg");
    ls = lam_seg->to(at::kFloat).contiguous();
    lam_ptr = ls.data_ptr<float>();
  }
  TORCH_CHECK_VALUE(rew.numel() == mask.numel() && val.numel() == mask.numel(),
                    "segment_gae: rewards, values and loss_mask must all be [T]");
  TORCH_CHECK_VALUE(cs.dim() == 1 && cg.dim() == 1 && cs.numel() >= 1 && cg.numel() >= 1,
                    "segment_gae: cu_seqlens and cu_segments must be 1-D with at least one element");
  at::Tensor st;
  if (seg_start.has_value()) {
    TORCH_CHECK_TYPE(seg_start->scalar_type() == at::kLong && seg_start->device().is_cpu(),
                     "segment_gae: seg_start must be an int64 CPU tensor");
    st = seg_start->contiguous();
    TORCH_CHECK_VALUE(st.dim() == 1 && st.numel() == cs.numel() - 1, "segment_gae: seg_start must be [S]");
  }
  AT_DISPATCH_INDEX_TYPES(cs.scalar_type(), "segment_gae_cpu_check", [&] {
    check_offsets<index_t>(cs.data_ptr<index_t>(), cs.numel(), mask.numel(), "cu_seqlens", "T");
    check_offsets<index_t>(cg.data_ptr<index_t>(), cg.numel(), cs.numel() - 1, "cu_segments", "S");
    if (st.defined()) check_starts<index_t>(st.data_ptr<int64_t>(), cs.data_ptr<index_t>(), cs.numel() - 1, mask.numel());
  });
  if (lam_mode == crf::kLamTensor)
    TORCH_CHECK_VALUE(ls.numel() == cs.numel() - 1, "segment_gae: lam_seg must be [S]");
  auto adv = crf::empty_output(rew.sizes(), rew.options()), ret = crf::empty_output(rew.sizes(), rew.options());
  const int64_t R = cg.numel() - 1, S = cs.numel() - 1;
  std::vector<int64_t> counts(S);
  std::vector<SegParams> params(S);
  // ~32K tokens per task (ATen's grain): a small batch stays on the calling thread, since waking a pool
  // thread costs more than scanning it (and, on a loaded machine, a whole scheduler time slice).
  const int64_t grain = std::max<int64_t>(1, R * 32768 / std::max<int64_t>(rew.numel(), 1));
  AT_DISPATCH_INDEX_TYPES(cs.scalar_type(), "segment_gae_cpu", [&] {
    const index_t* cu_seq = cs.data_ptr<index_t>();
    const index_t* cu_seg = cg.data_ptr<index_t>();
    const float *pr = rew.data_ptr<float>(), *pv = val.data_ptr<float>();
    const bool* pm = mask.data_ptr<bool>();
    float *pa = adv.data_ptr<float>(), *pt = ret.data_ptr<float>();
    at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        gae_rollout<index_t>(r, cu_seq, cu_seg, st.defined() ? st.data_ptr<int64_t>() : nullptr, pr, pv, pm, lam_ptr, gamma, lam, lam_mode, alpha, cross,
                             lam_critic, counts.data(), params.data(), pa, pt);
    });
  });
  return {adv, ret};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(compactionrl_fast, m) {
  m.def(
      "segment_gae(Tensor rewards, Tensor values, Tensor loss_mask, Tensor cu_seqlens, Tensor cu_segments, "
      "Tensor? lam_seg, float gamma, float lam, int lam_mode, float alpha, int cross, float lam_critic, "
      "Tensor? seg_start=None) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(compactionrl_fast, CPU, m) { m.impl("segment_gae", &segment_gae_cpu); }
