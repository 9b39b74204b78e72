// Host-side helpers shared by the CPU loss kernels (ppo_loss.cpp, value_loss.cpp).
//
// Tokens are cut into fixed blocks of kBlock tokens, independent of the thread count; each block writes
// one row of partial sums and the rows are added in block order, so every result bit is the same for
// any thread count. Inside a block, each run of tokens of one segment shares that segment's reduction
// weight, and is summed in float over chunks of at most kChunk tokens (one lane type keeps the loops
// vectorised; short chunks keep float rounding small) that are added in double.
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

// The segment of token t: the last s with cu[s] <= t (skips empty segments). Needs 0 <= t < cu[S].
template <typename idx_t>
CRF_INLINE int64_t segment_of(const idx_t* cu, int64_t S, int64_t t) {
  return std::upper_bound(cu, cu + S + 1, (idx_t)t) - cu - 1;
}

}  // namespace crf
