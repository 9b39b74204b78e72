// Output allocation shared by the C++/CUDA ops. With COMPACTIONRL_FAST_POISON=1 (set by the test suite)
// outputs start as NaN, so an element a kernel forgets to write fails the tests instead of passing as 0.
#pragma once
#include <ATen/ATen.h>
#include <cstdlib>
#include <cstring>

namespace crf {

inline bool poison_outputs() {
  const char* v = std::getenv("COMPACTIONRL_FAST_POISON");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

inline at::Tensor empty_output(at::IntArrayRef shape, const at::TensorOptions& opts) {
  at::Tensor t = at::empty(shape, opts);
  if (poison_outputs() && at::isFloatingType(t.scalar_type())) t.fill_(std::numeric_limits<float>::quiet_NaN());
  return t;
}

// The loss ops' per-token gradient output: [T] when asked for, else empty.
inline at::Tensor grad_output(bool need_grad, int64_t T, const at::TensorOptions& opts) {
  return need_grad ? empty_output({T}, opts) : at::empty({0}, opts);
}

}  // namespace crf
