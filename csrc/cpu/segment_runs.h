// Host-side helpers shared by the CPU loss kernels (ppo_loss.cpp, value_loss.cpp): the block/segment/chunk
// walk, its AVX2 and baseline copies and the parallel launch; a kernel supplies only its chunk function.
//
// Tokens are cut into fixed blocks of kBlock tokens, independent of the thread count; each block writes
// one row of partial sums and the rows are added in block order, so every result bit is the same for
// any thread count. Inside a block, each run of tokens of one segment shares that segment's reduction
// weight and is processed in chunks of at most kChunk tokens: a map loop writes the gradient and the
// masked per-token terms into a stack buffer, then `lane_sum` adds each buffer over kLanes float lanes
// in a fixed order, and the chunks are added in double.
//
// What gcc needs to vectorise the map loop (`#pragma omp simd reduction` does not make it so): no
// reductions in it, the mask read as a 32-bit int
// (a bool selecting a float does not vectorise), no bool fields in per-token structs, both arms of
// every select computed up front, and -fno-trapping-math on the kernel code (set with
// `#pragma GCC optimize` around it), without which gcc will not if-convert selects of float math.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>

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

// max(0, x[0..n)); drops NaN (a NaN check would keep this loop from vectorising: callers that must keep
// NaN look for it only when a sum of the same tokens came out NaN).
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

inline int64_t n_blocks(int64_t T) { return (T + kBlock - 1) / kBlock; }

// cu [S+1] must be offsets into [0, T]: cu[0] = 0, non-decreasing, cu[S] = T. The block walk below and
// segment_counts index memory with them, so they are checked here on the host (O(S), no device sync
// on CPU), also when the Python checks are skipped (torch.compile, COMPACTIONRL_FAST_CHECKS=0) or the
// op is called directly.
template <typename idx_t>
void check_offsets_host(const char* op, const idx_t* cu, int64_t S, int64_t T) {
  TORCH_CHECK_VALUE(S >= 0, op, ": cu_seqlens must have at least one element");
  TORCH_CHECK_VALUE(cu[0] == 0, op, ": cu_seqlens[0] must be 0, got ", (int64_t)cu[0]);
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK_VALUE(cu[s + 1] >= cu[s], op, ": cu_seqlens must be non-decreasing, but cu_seqlens[", s + 1,
                      "]=", (int64_t)cu[s + 1], " < cu_seqlens[", s, "]=", (int64_t)cu[s]);
  TORCH_CHECK_VALUE(cu[S] == T, op, ": cu_seqlens[-1] must equal T=", T, ", got ", (int64_t)cu[S]);
}

inline void check_offsets_host(const char* op, const at::Tensor& cu, int64_t T) {
  if (cu.scalar_type() == at::kInt)
    check_offsets_host(op, cu.data_ptr<int32_t>(), cu.numel() - 1, T);
  else
    check_offsets_host(op, cu.data_ptr<int64_t>(), cu.numel() - 1, T);
}

// A loss kernel's Args `a` has cu ([S+1] offsets or null: one segment), scale ([S] reduction weights),
// S, T and part ([n_blocks, kParts] doubles); its Chunk(a, t0, t1, w, p) adds tokens [t0, t1) (at most
// kChunk, one segment, weight w) into the block's partials p. Chunk is a template argument, not a
// callable object, so the call is direct and always_inline puts its loop into the AVX2 copy below.
template <auto Chunk, typename A>
CRF_INLINE void run_chunks(const A& a, int64_t t0, int64_t t1, double w, double* p) {
  for (int64_t c = t0; c < t1; c += kChunk) Chunk(a, c, std::min(t1, c + kChunk), w, p);
}

// Blocks [b0, b1): each block's partials start at 0 and its tokens are cut at segment boundaries.
template <auto Chunk, int kParts, typename A>
CRF_INLINE void run_blocks(const A& a, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    double* p = a.part + b * kParts;
    for (int k = 0; k < kParts; ++k) p[k] = 0.0;
    int64_t t0 = b * kBlock;
    const int64_t t1 = std::min(a.T, t0 + kBlock);
    if (a.cu == nullptr) {
      run_chunks<Chunk>(a, t0, t1, a.scale[0], p);
      continue;
    }
    for (int64_t s = segment_of(a.cu, a.S, t0); t0 < t1; ++s) {
      if (a.cu[s + 1] <= t0) continue;  // empty segment
      const int64_t e = std::min<int64_t>(a.cu[s + 1], t1);
      run_chunks<Chunk>(a, t0, e, a.scale[s], p);
      t0 = e;
    }
  }
}

template <auto Chunk, int kParts, typename A>
CRF_AVX2 void run_blocks_avx2(const A& a, int64_t b0, int64_t b1) {
  run_blocks<Chunk, kParts>(a, b0, b1);
}

template <auto Chunk, int kParts, typename A>
void run_blocks_base(const A& a, int64_t b0, int64_t b1) {
  run_blocks<Chunk, kParts>(a, b0, b1);
}

// All n_blocks(a.T) blocks, in parallel, through the AVX2 copy where the CPU has AVX2 and FMA.
template <auto Chunk, int kParts, typename A>
void parallel_blocks(const A& a) {
  const bool avx2 = has_avx2();
  at::parallel_for(0, n_blocks(a.T), kGrainBlocks, [&](int64_t b0, int64_t b1) {
    if (avx2)
      run_blocks_avx2<Chunk, kParts>(a, b0, b1);
    else
      run_blocks_base<Chunk, kParts>(a, b0, b1);
  });
}

// Calls f(idx_t{}, A, B) with the flags a, b as std::bool_constant, so each case gets its own kernel
// instantiation; idx_t is int32_t for an int32 cu_seqlens, else int64_t (int64 or no cu_seqlens).
template <typename F>
void dispatch(const std::optional<at::Tensor>& cu_seqlens, bool a, bool b, const F& f) {
  auto cases = [&](auto idx) {
    if (a && b) f(idx, std::true_type{}, std::true_type{});
    else if (a) f(idx, std::true_type{}, std::false_type{});
    else if (b) f(idx, std::false_type{}, std::true_type{});
    else f(idx, std::false_type{}, std::false_type{});
  };
  if (cu_seqlens && cu_seqlens->scalar_type() == at::kInt)
    cases(int32_t{});
  else
    cases(int64_t{});
}

// Calls f(float{}) or, for a float64 `t`, f(double{}): the loss kernels' input type.
template <typename F>
void dispatch_float(const at::Tensor& t, const F& f) {
  if (t.scalar_type() == at::kDouble)
    f(double{});
  else
    f(float{});
}

}  // namespace crf
