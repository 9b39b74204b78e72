// segment_gae on CPU, double accumulation. Schema: csrc/schemas.cpp; Python-facing semantics:
// compactionrl_fast/ops/gae.py; math: csrc/common/gae_step.h.
//   1. per rollout (in parallel): trainable counts and the per-segment numbers (crf::rollout_params);
//   2. the scan over "chains", the independent recurrences, lanes in lockstep (gae_lanes.h); a thread takes a
//      range of chains, and a chain long enough to outlast the others is cut into pieces scanned in two passes
//      (gae_cut.h).
// segment_gae_params: step 1 alone, the [4, S] numbers returned (compactionrl_fast.segment_params).
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../common/alloc.h"
#include "../common/count.h"
#include "../common/gae_step.h"
#include "gae_cut.h"
#include "gae_lanes.h"

namespace crf {

// The CPU scan's SIMD path: "auto" (the widest the CPU has), "avx512", "avx2" or "none" (asking for more than
// the CPU has gives what it has). COMPACTIONRL_FAST_CPU_SIMD sets it, read at the first call; a name given
// here (`compactionrl_fast._C.cpu_simd`) replaces it. Returns the setting in force.
std::string cpu_simd(const char* name);

}  // namespace crf

namespace {

using crf::SegParams;
using namespace crf::gae_cpu;

const char* const kSimdNames[] = {"auto", "avx512", "avx2", "none"};
std::atomic<int> simd_setting{-1};  // index into kSimdNames; -1: the environment's, not read yet

int simd_index(const char* name) {
  for (int i = 0; i < 4; ++i)
    if (std::strcmp(name, kSimdNames[i]) == 0) return i;
  return -1;
}

// Reads COMPACTIONRL_FAST_CPU_SIMD once, unless a setting is in force already; returns its value when that is
// not a SIMD name (then it is read again at the next call), else null.
const char* simd_env_error() {
  if (simd_setting.load() >= 0) return nullptr;
  const char* v = std::getenv("COMPACTIONRL_FAST_CPU_SIMD");
  const int i = v == nullptr || *v == 0 ? 0 : simd_index(v);
  if (i < 0) return v;
  simd_setting.store(i);
  return nullptr;
}

Simd simd_path() {
  static const Simd have = __builtin_cpu_supports("avx512f") ? kAvx512
                           : (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) ? kAvx2
                                                                                               : kScalar;
  const char* bad = simd_env_error();
  TORCH_CHECK_VALUE(bad == nullptr, "COMPACTIONRL_FAST_CPU_SIMD must be auto, avx512, avx2 or none, got '", bad, "'");
  const int i = simd_setting.load();
  return i <= 1 ? have : (i == 2 ? std::min(kAvx2, have) : kScalar);
}

// The per-segment numbers of rollout r: counts (when a mode needs them), then crf::rollout_params.
template <typename idx_t>
void rollout_numbers(int64_t r, const idx_t* cu_seq, const idx_t* cu_seg, const int64_t* start, const bool* mask,
                     const float* lam_seg, double gamma, double lam, int64_t lam_mode, double alpha, int64_t cross,
                     double lam_critic, int64_t* counts, SegParams* params) {
  const int64_t s0 = cu_seg[r], s1 = cu_seg[r + 1];
  const bool need_counts = crf::needs_counts(lam_mode, cross);
  if (need_counts)
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t b = start ? start[s] : (int64_t)cu_seq[s], e = b + (cu_seq[s + 1] - cu_seq[s]);
      counts[s] = crf::count_true(mask, b, e);
    }
  crf::rollout_params<idx_t>(s0, s1, cu_seq, need_counts ? counts : nullptr, lam_seg, gamma, lam, lam_mode, alpha,
                             cross, lam_critic, params);
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

// The per-segment numbers alone, float64 [4, S] (rows gl, glc, scale, reset of crf::SegParams): what the scans
// read, for callers that report them (compactionrl_fast.segment_params). Same checks and code as segment_gae_cpu.
at::Tensor segment_gae_params_cpu(const at::Tensor& loss_mask, const at::Tensor& cu_seqlens,
                                  const at::Tensor& cu_segments, const std::optional<at::Tensor>& lam_seg,
                                  double gamma, double lam, int64_t lam_mode, double alpha, int64_t cross,
                                  double lam_critic) {
  TORCH_CHECK(loss_mask.device().is_cpu() && cu_seqlens.device().is_cpu() && cu_segments.device().is_cpu(),
              "segment_gae_params: all tensors must be on the CPU");
  TORCH_CHECK(loss_mask.scalar_type() == at::kBool, "segment_gae_params: loss_mask must be bool");
  TORCH_CHECK(cu_seqlens.scalar_type() == cu_segments.scalar_type(),
              "segment_gae_params: cu_seqlens and cu_segments must share a dtype");
  TORCH_CHECK_VALUE(cu_seqlens.dim() == 1 && cu_segments.dim() == 1 && cu_seqlens.numel() >= 1 &&
                        cu_segments.numel() >= 1,
                    "segment_gae_params: cu_seqlens and cu_segments must be 1-D with at least one element");
  auto mask = loss_mask.contiguous(), cs = cu_seqlens.contiguous(), cg = cu_segments.contiguous();
  const int64_t R = cg.numel() - 1, S = cs.numel() - 1, T = mask.numel();
  at::Tensor ls;
  const float* lam_ptr = nullptr;
  if (lam_mode == crf::kLamTensor) {
    TORCH_CHECK(lam_seg.has_value(), "segment_gae_params: lam_mode=tensor needs lam_seg");
    ls = lam_seg->to(at::kFloat).contiguous();
    TORCH_CHECK_VALUE(ls.numel() == S, "segment_gae_params: lam_seg must be [S]");
    lam_ptr = ls.data_ptr<float>();
  }
  std::vector<int64_t> counts(S);
  std::vector<SegParams> params(S);
  const int64_t grain = std::max<int64_t>(1, R * 32768 / std::max<int64_t>(T, 1));  // as in segment_gae_cpu
  AT_DISPATCH_INDEX_TYPES(cs.scalar_type(), "segment_gae_params_cpu", [&] {
    const index_t* cu_seq = cs.data_ptr<index_t>();
    const index_t* cu_seg = cg.data_ptr<index_t>();
    check_offsets<index_t>(cu_seq, cs.numel(), T, "cu_seqlens", "T");
    check_offsets<index_t>(cu_seg, cg.numel(), S, "cu_segments", "S");
    const bool* pm = mask.data_ptr<bool>();
    at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        rollout_numbers<index_t>(r, cu_seq, cu_seg, nullptr, pm, lam_ptr, gamma, lam, lam_mode, alpha, cross,
                                 lam_critic, counts.data(), params.data());
    });
  });
  auto out = crf::empty_output({4, S}, mask.options().dtype(at::kDouble));
  double* o = out.data_ptr<double>();
  for (int64_t s = 0; s < S; ++s) {
    o[s] = params[s].gl;
    o[S + s] = params[s].glc;
    o[2 * S + s] = params[s].scale;
    o[3 * S + s] = params[s].reset;
  }
  return out;
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
  const int64_t R = cg.numel() - 1, S = cs.numel() - 1, T = rew.numel();
  std::vector<int64_t> counts(S);
  std::vector<SegParams> params(S);
  // ~32K tokens per task (ATen's grain): a small batch stays on the calling thread, since waking a pool
  // thread costs more than scanning it.
  const int64_t grain = std::max<int64_t>(1, R * 32768 / std::max<int64_t>(T, 1));
  const int64_t* pst = st.defined() ? st.data_ptr<int64_t>() : nullptr;
  AT_DISPATCH_INDEX_TYPES(cs.scalar_type(), "segment_gae_cpu", [&] {
    const index_t* cu_seq = cs.data_ptr<index_t>();
    const index_t* cu_seg = cg.data_ptr<index_t>();
    const bool* pm = mask.data_ptr<bool>();
    at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        rollout_numbers<index_t>(r, cu_seq, cu_seg, pst, pm, lam_ptr, gamma, lam, lam_mode, alpha, cross, lam_critic,
                                 counts.data(), params.data());
    });
    std::vector<Chain> chains;  // each starts (from the end) at a segment with reset = 1
    for (int64_t s = S - 1; s >= 0; --s) {
      if (params[s].reset != 0.0 || chains.empty()) chains.push_back({s, s, 0});
      else chains.back().lo = s;
    }
    for (Chain& c : chains) c.tokens = (int64_t)cu_seq[c.hi + 1] - (int64_t)cu_seq[c.lo];
    ChainScan<index_t> scan{cu_seq, pst, params.data(), rew.data_ptr<float>(), val.data_ptr<float>(), pm,
                            gamma, lam_critic >= 0.0, adv.data_ptr<float>(), ret.data_ptr<float>(), simd_path(),
                            nullptr};
    Cut cut = cut_long_chains(scan, chains, T);
    if (cut.first.empty()) return run_parallel(scan, chains);
    std::vector<crf::GaeState> finals(cut.first.size());
    scan.finals = finals.data();
    run_parallel(scan, cut.first);
    carry_pieces(scan, cut, finals);
    run_parallel(scan, cut.second);
  });
  return {adv, ret};
}

}  // namespace

std::string crf::cpu_simd(const char* name) {
  const char* bad = name != nullptr ? (simd_index(name) < 0 ? name : nullptr) : simd_env_error();
  if (bad != nullptr)
    throw std::invalid_argument(std::string(name != nullptr ? "cpu_simd" : "COMPACTIONRL_FAST_CPU_SIMD") +
                                " must be auto, avx512, avx2 or none, got '" + bad + "'");
  if (name != nullptr) simd_setting.store(simd_index(name));
  return kSimdNames[simd_setting.load()];
}

TORCH_LIBRARY_IMPL(compactionrl_fast, CPU, m) {
  m.impl("segment_gae", &segment_gae_cpu);
  m.impl("segment_gae_params", &segment_gae_params_cpu);
}
