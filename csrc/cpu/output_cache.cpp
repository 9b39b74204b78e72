// The CPU ops' large outputs come from blocks that earlier outputs of the same size class gave back, so a
// call does not pay a minor page fault per 4 KiB of fresh memory whenever glibc has returned freed blocks
// to the OS (which depends on what the process did before).
#include "../common/alloc.h"

#include <ATen/EmptyTensor.h>
#include <c10/core/impl/alloc_cpu.h>

#include <mutex>
#include <unordered_map>
#include <vector>

namespace crf {
namespace {

constexpr size_t kMinBytes = size_t(1) << 20;  // smaller blocks: glibc's heap already reuses them

// 4 classes per power of two (waste < 25%), page multiples.
size_t size_class(size_t n) {
  size_t p = size_t(1) << (63 - __builtin_clzll(n));
  size_t c = p;
  while (c < n) c += p / 4;
  return (c + 4095) & ~size_t(4095);
}

class OutputCache final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    if (n < kMinBytes) return c10::GetAllocator(c10::DeviceType::CPU)->allocate(n);
    const size_t cls = size_class(n);
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = free_.find(cls);
      if (it != free_.end() && !it->second.empty()) {
        p = it->second.back();
        it->second.pop_back();
        cached_ -= cls;
        ++hits_;
      } else {
        ++misses_;
      }
    }
    if (p == nullptr) p = c10::alloc_cpu(cls);
    return {p, new Block{p, cls}, &OutputCache::release, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // -> {cached bytes, limit, hits, misses}; limit >= 0 sets the limit (0 also empties the cache);
  // clear frees every cached block.
  std::vector<int64_t> control(int64_t limit, bool clear) {
    std::vector<void*> drop;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (limit >= 0) limit_ = size_t(limit);
      for (auto& kv : free_) {
        while (!kv.second.empty() && (clear || cached_ > limit_)) {
          drop.push_back(kv.second.back());
          kv.second.pop_back();
          cached_ -= kv.first;
        }
      }
    }
    for (void* p : drop) c10::free_cpu(p);
    std::lock_guard<std::mutex> g(mu_);
    return {int64_t(cached_), int64_t(limit_), hits_, misses_};
  }

  static OutputCache& get() {
    static OutputCache* c = new OutputCache();  // never destroyed: tensors may outlive static destructors
    return *c;
  }

 private:
  struct Block {
    void* p;
    size_t size;
  };

  static void release(void* ctx) {
    auto* b = static_cast<Block*>(ctx);
    get().put(b->p, b->size);
    delete b;
  }

  void put(void* p, size_t cls) {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (cached_ + cls <= limit_) {
        free_[cls].push_back(p);
        cached_ += cls;
        return;
      }
    }
    c10::free_cpu(p);
  }

  std::mutex mu_;
  std::unordered_map<size_t, std::vector<void*>> free_;
  size_t cached_ = 0, limit_ = size_t(256) << 20;
  int64_t hits_ = 0, misses_ = 0;
};

}  // namespace

at::Tensor cpu_output_empty(at::IntArrayRef shape, const at::TensorOptions& opts) {
  return at::detail::empty_generic(shape, &OutputCache::get(), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   opts.dtype().toScalarType(), opts.memory_format_opt());
}

std::vector<int64_t> cpu_output_cache(int64_t limit, bool clear) { return OutputCache::get().control(limit, clear); }

}  // namespace crf
