// Host-side helpers shared by the CPU loss kernels (ppo_loss.cpp, value_loss.cpp).
//
// Tokens are cut into fixed blocks of kBlock tokens, independent of the thread count; each block writes
// one row of partial sums and the rows are added in block order, so every result bit is the same for
// any thread count. Inside a block, each run of tokens of one segment shares that segment's reduction
// weight and is processed in chunks of at most kChunk tokens: a map loop writes the gradient and the
// masked per-token terms into a stack buffer, then `lane_sum` adds each buffer over kLanes float lanes
// in a fixed order, and the chunks are added in double.
//
// What gcc 12 needs to vectorise the map loop (checked with objdump; `#pragma omp simd reduction` was
// reported vectorised and then emitted scalar): no reductions in it, the mask read as a 32-bit int
// (a bool selecting a float does not vectorise), no bool fields in per-token structs, both arms of
// every select computed up front, and -fno-trapping-math on the kernel code (set with
// `#pragma GCC optimize` around it), without which gcc will not if-convert selects of float math.
#pragma once
#include <algorithm>
#include <cstdint>

namespace crf {

constexpr int64_t kBlock = 8192;
constexpr int64_t kChunk = 512;
// Blocks per parallel task at least: small batches run on the calling thread (no parallel region, whose
// start-up costs more than the work below ~16K tokens).
constexpr int64_t kGrainBlocks = 2;

// Hot loops are compiled twice: for AVX2+FMA and for the baseline ISA; `has_avx2()` picks one at run
// time. The loop bodies are always_inline templates, so they take the caller's target.
#define CRF_AVX2 __attribute__((target("avx2,fma")))
#define CRF_INLINE inline __attribute__((always_inline))

inline bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}

constexpr int kLanes = 8;

// sum of x[0..n) over kLanes float lanes, the lanes added in order in double.
CRF_INLINE double lane_sum(const float* x, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += x[i + j];
  for (int j = 0; i < n; ++i, ++j) acc[j] += x[i];
  double s = 0.0;
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}

// max(0, x[0..n)).
CRF_INLINE float lane_max(const float* x, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] = x[i + j] > acc[j] ? x[i + j] : acc[j];
  for (int j = 0; i < n; ++i, ++j) acc[j] = x[i] > acc[j] ? x[i] : acc[j];
  float m = 0.0f;
  for (int j = 0; j < kLanes; ++j) m = acc[j] > m ? acc[j] : m;
  return m;
}

// The segment of token t: the last s with cu[s] <= t (skips empty segments). Needs 0 <= t < cu[S].
template <typename idx_t>
CRF_INLINE int64_t segment_of(const idx_t* cu, int64_t S, int64_t t) {
  return std::upper_bound(cu, cu + S + 1, (idx_t)t) - cu - 1;
}

}  // namespace crf
