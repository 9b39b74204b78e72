// mask_to_bool on CPU: a 0/1 mask of a numeric dtype as bool, in one pass that also counts its True values and
// finds any value other than 0 and 1 (NaN is one), so that the adapters' `as_bool_mask`
// (compactionrl_fast/integrations/padded.py) converts and checks verl's and OpenRLHF's int or float masks
// without `m != 0`, a reduction for the check and their [T] temporaries.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <type_traits>
#include <vector>

#include "segment_runs.h"

namespace {

constexpr int64_t kMaskBlock = 1 << 16;  // fits the int32 per-block counts

// Integers: out[i] = in[i] as a byte, the sum of the values and an OR of (unsigned) in[i] >> 1, which is 0
// iff every value is 0 or 1; then the bytes are the bool mask and the sum its count (otherwise the caller
// refuses the mask and neither is used). Shifts, ORs and adds at the input's width: gcc packs them into
// vectors with one narrowing per store. Floats: out[i] = in[i] != 0, with the counts of nonzero values and
// of those other than 1 (NaN is one).
template <typename T>
CRF_INLINE void convert_run(const T* __restrict in, uint8_t* __restrict out, int64_t n, int64_t* counts) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    using acc_t = std::conditional_t<sizeof(T) == 8, uint64_t, uint32_t>;  // n <= kMaskBlock: no overflow
    acc_t sum = 0;
    U high = 0;
    for (int64_t i = 0; i < n; ++i) {
      const U v = (U)in[i];
      out[i] = (uint8_t)v;
      sum += v;
      high |= (U)(v >> 1);
    }
    counts[0] = (int64_t)sum;
    counts[1] = high != 0;
  } else {
    int32_t nonzero = 0, other = 0;
    for (int64_t i = 0; i < n; ++i) {
      const T v = in[i];
      const int32_t nz = v != T(0), one = v == T(1);
      out[i] = (uint8_t)nz;
      nonzero += nz;
      other += nz & (one ^ 1);  // NaN: nonzero and not 1
    }
    counts[0] = nonzero;
    counts[1] = other;
  }
}

template <typename T>
CRF_AVX2 void convert_avx2(const T* in, uint8_t* out, int64_t n, int64_t* counts) {
  convert_run<T>(in, out, n, counts);
}

template <typename T>
void convert_base(const T* in, uint8_t* out, int64_t n, int64_t* counts) {
  convert_run<T>(in, out, n, counts);
}

// (mask as bool, int64 [2]: (its True values, > 0 iff a value is neither 0 nor 1)); the first two are
// meaningful only where the second count is 0.
std::tuple<at::Tensor, at::Tensor> mask_to_bool_cpu(const at::Tensor& mask) {
  const auto in = mask.contiguous();
  at::Tensor out = at::empty(mask.sizes(), mask.options().dtype(at::kBool));
  const int64_t n = in.numel(), blocks = (n + kMaskBlock - 1) / kMaskBlock;
  std::vector<int64_t> parts(2 * blocks, 0);
  uint8_t* po = reinterpret_cast<uint8_t*>(out.data_ptr<bool>());
  AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, in.scalar_type(), "mask_to_bool_cpu", [&] {
    const scalar_t* pi = in.data_ptr<scalar_t>();
    const bool avx2 = crf::has_avx2();
    at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t t0 = b * kMaskBlock, len = std::min(kMaskBlock, n - t0);
        (avx2 ? convert_avx2<scalar_t> : convert_base<scalar_t>)(pi + t0, po + t0, len, &parts[2 * b]);
      }
    });
  });
  at::Tensor counts = at::zeros({2}, mask.options().dtype(at::kLong));
  int64_t* pc = counts.data_ptr<int64_t>();
  for (int64_t b = 0; b < blocks; ++b) {
    pc[0] += parts[2 * b];
    pc[1] += parts[2 * b + 1];
  }
  return {out, counts};
}

}  // namespace

TORCH_LIBRARY_IMPL(compactionrl_fast, CPU, m) { m.impl("mask_to_bool", &mask_to_bool_cpu); }
