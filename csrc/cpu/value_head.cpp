// value_head on CPU: values[t] = sum_h hidden[t, h] * weight[h] + bias for bf16/fp16/fp32 hidden, with
// float32 accumulation and no float32 copy of hidden. The backward reads hidden once, writing d_hidden
// and accumulating d_weight into a fixed number of row-group partials that are added in order, so
// d_weight is bitwise the same for any thread count.
// Python-facing semantics: compactionrl_fast/ops/value_head.py.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <torch/types.h>

#include "../common/alloc.h"
#include "segment_runs.h"

namespace {

constexpr int kLanes = 16;       // independent float accumulators of a dot product (vectorisable)
constexpr int64_t kParts = 64;   // d_weight row-group partials at most
constexpr int64_t kMinRows = 256;

// sum_h x[h] * w[h] over kLanes lanes, lanes added in a fixed order.
template <typename scalar_t>
CRF_INLINE float dot(const scalar_t* x, const float* w, int64_t H) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= H; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += static_cast<float>(x[i + j]) * w[i + j];
  for (int j = 0; i + j < H; ++j) acc[j] += static_cast<float>(x[i + j]) * w[i + j];
  float s = 0.0f;
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}

template <typename scalar_t>
CRF_INLINE void fwd_rows(const scalar_t* h, const float* w, float b, float* out, int64_t t0, int64_t t1,
                         int64_t H) {
  for (int64_t t = t0; t < t1; ++t) out[t] = dot(h + t * H, w, H) + b;
}

template <typename scalar_t>
CRF_AVX2 void fwd_rows_avx2(const scalar_t* h, const float* w, float b, float* out, int64_t t0, int64_t t1,
                            int64_t H) {
  fwd_rows(h, w, b, out, t0, t1, H);
}

// Rows [t0, t1): d_hidden[t] = g[t] * w (rounded to scalar_t), part += g[t] * hidden[t].
template <typename scalar_t>
CRF_INLINE void bwd_rows(const scalar_t* h, const float* w, const float* g, scalar_t* dh, float* part,
                         int64_t t0, int64_t t1, int64_t H) {
  for (int64_t t = t0; t < t1; ++t) {
    const float gt = g[t];
    if (dh != nullptr) {
      scalar_t* d = dh + t * H;
      // a zero-gradient row (a masked token) gets 0, not 0 * an inf/NaN weight
      if (gt == 0.0f)
        for (int64_t i = 0; i < H; ++i) d[i] = scalar_t(0);
      else
        for (int64_t i = 0; i < H; ++i) d[i] = static_cast<scalar_t>(gt * w[i]);
    }
    // a row with a zero gradient (a masked token) adds nothing, even if it holds inf/NaN (0 * NaN = NaN)
    if (part != nullptr && gt != 0.0f) {
      const scalar_t* x = h + t * H;
      for (int64_t i = 0; i < H; ++i) part[i] += static_cast<float>(x[i]) * gt;
    }
  }
}

template <typename scalar_t>
CRF_AVX2 void bwd_rows_avx2(const scalar_t* h, const float* w, const float* g, scalar_t* dh, float* part,
                            int64_t t0, int64_t t1, int64_t H) {
  bwd_rows(h, w, g, dh, part, t0, t1, H);
}

void check_head(const at::Tensor& hidden, const at::Tensor& weight) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "value_head: hidden must be a contiguous [T, H] tensor");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 && weight.numel() == hidden.size(1) &&
                  weight.is_contiguous(),
              "value_head: weight must be a contiguous float32 [H] tensor");
}

at::Tensor value_head_fwd_cpu(const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check_head(hidden, weight);
  const int64_t T = hidden.size(0), H = hidden.size(1);
  const float b = bias ? bias->item<float>() : 0.0f;
  at::Tensor out = crf::empty_output({T}, weight.options());
  const bool avx2 = crf::has_avx2();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hidden.scalar_type(), "value_head_fwd_cpu", [&] {
    const scalar_t* h = hidden.data_ptr<scalar_t>();
    const float* w = weight.data_ptr<float>();
    float* o = out.data_ptr<float>();
    at::parallel_for(0, T, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(H, 1)), [&](int64_t t0, int64_t t1) {
      if (avx2) fwd_rows_avx2(h, w, b, o, t0, t1, H);
      else fwd_rows(h, w, b, o, t0, t1, H);
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> value_head_bwd_cpu(const at::Tensor& hidden, const at::Tensor& weight,
                                                      const at::Tensor& grad, bool need_dh, bool need_dw) {
  check_head(hidden, weight);
  const int64_t T = hidden.size(0), H = hidden.size(1);
  TORCH_CHECK(grad.scalar_type() == at::kFloat && grad.numel() == T && grad.is_contiguous(),
              "value_head: grad must be a contiguous float32 [T] tensor");
  at::Tensor dh = need_dh ? crf::empty_output({T, H}, hidden.options()) : at::empty({0}, hidden.options());
  at::Tensor dw = need_dw ? crf::empty_output({H}, weight.options()) : at::empty({0}, weight.options());
  // a fixed split of the rows into n_parts groups (a function of T only): each group sums its rows'
  // d_weight contributions in order, then the groups are added in order
  const int64_t n_parts = std::max<int64_t>(1, std::min(kParts, T / kMinRows));
  const int64_t rows = (T + n_parts - 1) / n_parts;
  at::Tensor part_t = at::zeros({need_dw ? n_parts : 0, H}, weight.options());
  float* part = part_t.data_ptr<float>();
  const bool avx2 = crf::has_avx2();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hidden.scalar_type(), "value_head_bwd_cpu", [&] {
    const scalar_t* h = hidden.data_ptr<scalar_t>();
    const float* w = weight.data_ptr<float>();
    const float* g = grad.data_ptr<float>();
    scalar_t* d = need_dh ? dh.data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, n_parts, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        float* pp = need_dw ? part + p * H : nullptr;
        const int64_t t0 = p * rows, t1 = std::min(T, t0 + rows);
        if (avx2) bwd_rows_avx2(h, w, g, d, pp, t0, t1, H);
        else bwd_rows(h, w, g, d, pp, t0, t1, H);
      }
    });
  });
  if (need_dw) {
    float* o = dw.data_ptr<float>();
    for (int64_t i = 0; i < H; ++i) o[i] = 0.0f;
    for (int64_t p = 0; p < n_parts; ++p)
      for (int64_t i = 0; i < H; ++i) o[i] += part[p * H + i];
  }
  return {dh, dw};
}

}  // namespace

TORCH_LIBRARY_IMPL(compactionrl_fast, CPU, m) {
  m.impl("value_head_fwd", &value_head_fwd_cpu);
  m.impl("value_head_bwd", &value_head_bwd_cpu);
}
