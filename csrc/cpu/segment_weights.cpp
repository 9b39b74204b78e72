// segment_weights on CPU: the loss reductions' weight of each segment's tokens, float64 [S], in one call
// (counts, the averaging unit's counts, D, the weights). Semantics: compactionrl_fast/ops/_reduction.py
// (the Triton port: kernels/segments.py `_segment_weights_kernel`).
//   reduction (csrc/common/modes.h) "token-mean": 1/D, D = trainable tokens; "segment-mean": 1/(n_s D), D =
//   segments with a trainable token; "rollout-mean": 1/(n_r D), D = rollouts with one; "sum": 1. A given denominator
//   (den >= 0, or the one-element tensor den_t) replaces D; 1/0 = 0; a negative or NaN D gives NaN.
#include <torch/library.h>
#include <torch/types.h>

#include <cmath>
#include <limits>
#include <vector>

#include "../common/modes.h"

namespace {

double inverse_count(double x) { return x > 0 ? 1.0 / x : 0.0; }

double inverse_denominator(double d) {
  if (d > 0) return 1.0 / d;
  return d == 0 ? 0.0 : std::numeric_limits<double>::quiet_NaN();
}

template <typename idx_t>
void check_offsets(const idx_t* cu, int64_t n, int64_t total, const char* name) {
  TORCH_CHECK_VALUE(n >= 1 && cu[0] == 0, "segment_weights: ", name, "[0] must be 0");
  for (int64_t i = 1; i < n; ++i)
    TORCH_CHECK_VALUE(cu[i] >= cu[i - 1], "segment_weights: ", name, " must be non-decreasing at ", i);
  TORCH_CHECK_VALUE(cu[n - 1] == total, "segment_weights: ", name, "[-1] must be ", total, ", got ", (int64_t)cu[n - 1]);
}

at::Tensor segment_weights_cpu(const at::Tensor& loss_mask, const std::optional<at::Tensor>& cu_seqlens,
                               const std::optional<at::Tensor>& cu_segments, int64_t reduction, double den,
                               const std::optional<at::Tensor>& den_t) {
  TORCH_CHECK_TYPE(loss_mask.scalar_type() == at::kBool && loss_mask.dim() == 1,
                   "segment_weights: loss_mask must be a bool [T] tensor");
  TORCH_CHECK_VALUE(reduction >= crf::kReductionTokenMean && reduction <= crf::kReductionSum,
                    "segment_weights: reduction must be ", (int64_t)crf::kReductionTokenMean, "..",
                    (int64_t)crf::kReductionSum);
  auto mask = loss_mask.contiguous();
  const int64_t T = mask.numel();
  const bool given = den_t.has_value() || den >= 0;
  if (reduction == crf::kReductionTokenMean && given && !cu_seqlens.has_value()) {  // nothing to count
    at::Tensor out = at::empty({1}, mask.options().dtype(at::kDouble));
    out.fill_(inverse_denominator(den_t.has_value() ? den_t->to(at::kDouble).item<double>() : den));
    return out;
  }
  const uint8_t* pm = reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>());
  // counts per segment (one segment when cu_seqlens is None)
  std::vector<int64_t> n;
  at::Tensor cs, cg;
  if (cu_seqlens.has_value()) {
    cs = cu_seqlens->contiguous();
    TORCH_CHECK_VALUE(cs.dim() == 1 && cs.numel() >= 1, "segment_weights: cu_seqlens must be [S+1]");
    AT_DISPATCH_INDEX_TYPES(cs.scalar_type(), "segment_weights_counts", [&] {
      const index_t* cu = cs.data_ptr<index_t>();
      check_offsets<index_t>(cu, cs.numel(), T, "cu_seqlens");
      n.resize(cs.numel() - 1);
      for (size_t s = 0; s < n.size(); ++s) {
        int64_t c = 0;
        for (int64_t t = cu[s]; t < cu[s + 1]; ++t) c += pm[t];
        n[s] = c;
      }
    });
  } else {
    int64_t c = 0;
    for (int64_t t = 0; t < T; ++t) c += pm[t];
    n.assign(1, c);
  }
  const int64_t S = (int64_t)n.size();
  at::Tensor out = at::empty({S}, mask.options().dtype(at::kDouble));
  double* w = out.data_ptr<double>();
  if (reduction == crf::kReductionSum) {
    for (int64_t s = 0; s < S; ++s) w[s] = 1.0;
    return out;
  }
  double d_given = den;
  if (den_t.has_value()) {
    TORCH_CHECK_VALUE(den_t->numel() == 1, "segment_weights: the denominator tensor must have one element");
    d_given = den_t->to(at::kDouble).item<double>();  // a CPU tensor: no sync
  }
  // n_unit[s]: trainable tokens of segment s's averaging unit; D: the units with a trainable token
  std::vector<int64_t> unit(n);
  double D = 0;
  if (reduction == crf::kReductionTokenMean) {
    for (int64_t s = 0; s < S; ++s) D += (double)n[s];
  } else if (reduction == crf::kReductionRolloutMean && cu_segments.has_value()) {
    cg = cu_segments->contiguous();
    AT_DISPATCH_INDEX_TYPES(cg.scalar_type(), "segment_weights_rollouts", [&] {
      const index_t* cr = cg.data_ptr<index_t>();
      check_offsets<index_t>(cr, cg.numel(), S, "cu_segments");
      for (int64_t r = 0; r + 1 < cg.numel(); ++r) {
        int64_t c = 0;
        for (int64_t s = cr[r]; s < cr[r + 1]; ++s) c += n[s];
        for (int64_t s = cr[r]; s < cr[r + 1]; ++s) unit[s] = c;
        D += c > 0;
      }
    });
  } else {
    for (int64_t s = 0; s < S; ++s) D += n[s] > 0;
  }
  const double inv_d = given ? inverse_denominator(d_given) : inverse_count(D);
  for (int64_t s = 0; s < S; ++s)
    w[s] = reduction == crf::kReductionTokenMean ? inv_d : inverse_count((double)unit[s]) * inv_d;
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(compactionrl_fast, CPU, m) { m.impl("segment_weights", &segment_weights_cpu); }
