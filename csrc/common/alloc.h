// Output allocation shared by the C++/CUDA ops. With COMPACTIONRL_FAST_POISON=1 (set by the test suite before
// the first op; read once) outputs start as NaN, so an element a kernel forgets to write fails the tests
// instead of passing as 0.
#pragma once
#include <ATen/ATen.h>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace crf {

// csrc/cpu/output_cache.cpp: CPU tensors whose large blocks are reused across calls (no fresh pages).
at::Tensor cpu_output_empty(at::IntArrayRef shape, const at::TensorOptions& opts);
// -> {cached bytes, limit bytes, hits, misses}; limit >= 0 sets the limit; clear frees every cached block.
std::vector<int64_t> cpu_output_cache(int64_t limit, bool clear);

inline bool poison_outputs() {
  static const bool on = [] {
    const char* v = std::getenv("COMPACTIONRL_FAST_POISON");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return on;
}

inline at::Tensor empty_output(at::IntArrayRef shape, const at::TensorOptions& opts) {
  at::Tensor t = opts.device().is_cpu() ? cpu_output_empty(shape, opts) : at::empty(shape, opts);
  if (poison_outputs() && at::isFloatingType(t.scalar_type())) t.fill_(std::numeric_limits<float>::quiet_NaN());
  return t;
}

// The loss ops' per-token gradient output: [T] when asked for, else empty.
inline at::Tensor grad_output(bool need_grad, int64_t T, const at::TensorOptions& opts) {
  return need_grad ? empty_output({T}, opts) : at::empty({0}, opts);
}

}  // namespace crf
