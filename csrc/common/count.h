// Trainable tokens in a run of the loss mask: the bytes (0 or 1) of mask[b, e) added.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>

namespace crf {

// Eight bytes per add: a word's bytes are added in byte lanes, at most 255 words per round so that no lane
// overflows, then the lanes are added (gcc leaves the byte-by-byte loop scalar).
inline int64_t count_true(const void* mask, int64_t b, int64_t e) {
  const unsigned char* m = static_cast<const unsigned char*>(mask);
  int64_t c = 0, t = b;
  while (e - t >= 8) {
    uint64_t acc = 0;
    for (const int64_t stop = t + 8 * std::min<int64_t>(255, (e - t) / 8); t < stop; t += 8) {
      uint64_t w;
      std::memcpy(&w, m + t, 8);
      acc += w;
    }
    acc = (acc & 0x00FF00FF00FF00FFull) + ((acc >> 8) & 0x00FF00FF00FF00FFull);  // 4 lanes of 16 bits
    c += (int64_t)((acc * 0x0001000100010001ull) >> 48);
  }
  for (; t < e; ++t) c += m[t];
  return c;
}

}  // namespace crf
