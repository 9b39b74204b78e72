// CUDA kernels of segment_gae (no torch headers: tests/test_aot.py compiles this file on its own, and
// tests/ops/test_gae.py runs it on the host through tests/cuda_host_emu.h).
// Per-segment numbers and the per-token step are the CPU kernel's (csrc/common/gae_step.h):
//   1. count_kernel: trainable tokens per segment (one block per segment, fixed-order reduction);
//   2. segment_kernel: one thread per rollout walks its segments backwards like the CPU kernel and
//      stores gamma*lam, gamma*lam_critic, the paper's scale and whether the recurrence stops after it;
//   3. tile_kernel<WRITE=false>: each block of kTile tokens composes its tokens' carry maps (GaeMap);
//   4. carry_kernel: one block composes the tile maps from the last tile back: each tile's carry-in;
//   5. tile_kernel<WRITE=true>: each thread runs the CPU recurrence (gae_step) over its kItems tokens from
//      its exact carry-in (tile carry-in, then the maps of the later threads of the tile).
// Steps 3-4 are skipped when the batch fits in one tile. Threads exchange data only through shared
// memory and __syncthreads (no warp intrinsics), so the host emulation runs the same code.
// The torch binding is csrc/cuda/gae.cu; semantics: compactionrl_fast/ops/gae.py.
#pragma once
#include "kernel_common.cuh"

#include "../common/gae_step.h"

namespace crf {
namespace gae_cuda {

// Tile shape; the host-emulation tests also build it small to cross many tiles (powers of two).
#ifndef CRF_GAE_THREADS
#define CRF_GAE_THREADS 256
#endif
#ifndef CRF_GAE_ITEMS
#define CRF_GAE_ITEMS 8
#endif
constexpr int kThreads = CRF_GAE_THREADS;
constexpr int kItems = CRF_GAE_ITEMS;     // consecutive tokens per thread
constexpr int kTile = kThreads * kItems;  // tokens per block

struct Params {
  const float *rew, *val;  // [T]
  const bool* mask;        // [T]
  const void *cu_seq, *cu_seg;  // [S+1], [R+1], int32 or int64
  const float* lam_seg;    // [S] or null
  int64_t T, S, R;
  double gamma, lam, alpha, lam_critic;  // lam_critic < 0: the returns reuse the advantages' recurrence
  int64_t lam_mode, cross;               // crf::LamMode, crf::CrossMode
  int64_t* counts;    // [S] scratch, null unless paper or adaptive lambda
  SegParams* seg;     // [S] scratch
  GaeMap* maps;       // [n_tiles] scratch
  GaeState* carry;    // [n_tiles] scratch
  float *adv, *ret;   // [T] outputs
};

inline int64_t n_tiles(int64_t T) { return (T + kTile - 1) / kTile; }

// Shared-memory index with one pad word per 32: thread i reads tokens i*kItems.. without 8-way bank conflicts.
__device__ __forceinline__ int pad(int k) { return k + (k >> 5); }
constexpr int kPadded = kTile + kTile / 32;

template <typename idx_t>
__global__ void __launch_bounds__(kThreads) count_kernel(Params p) {
  __shared__ int64_t part[kThreads];
  const idx_t* cu = static_cast<const idx_t*>(p.cu_seq);
  const int64_t s = blockIdx.x, a0 = cu[s], a1 = cu[s + 1];
  int64_t n = 0;
  for (int64_t t = a0 + threadIdx.x; t < a1; t += kThreads) n += p.mask[t];
  part[threadIdx.x] = n;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w >>= 1) {
    if ((int)threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) p.counts[s] = part[0];
}

template <typename idx_t>
__global__ void __launch_bounds__(kThreads) segment_kernel(Params p) {
  const int64_t r = (int64_t)blockIdx.x * kThreads + threadIdx.x;
  if (r >= p.R) return;
  const idx_t* cs = static_cast<const idx_t*>(p.cu_seg);
  rollout_params<idx_t>(cs[r], cs[r + 1], static_cast<const idx_t*>(p.cu_seq), p.counts, p.lam_seg, p.gamma, p.lam,
                        p.lam_mode, p.alpha, p.cross, p.lam_critic, p.seg);
}

// One tile: stage tokens in shared memory (coalesced), each thread composes the maps of its kItems tokens,
// a reverse inclusive scan gives map(thread i) after map(i+1) after ...; phase 1 stores the tile's map,
// phase 3 runs the CPU recurrence per thread from its carry-in and stores adv/ret (coalesced).
template <typename idx_t, bool WRITE>
__global__ void __launch_bounds__(kThreads) tile_kernel(Params p) {
  __shared__ float s_r[kPadded], s_v[kPadded];
  __shared__ bool s_m[kPadded];
  __shared__ GaeMap s_map[kThreads];
  const idx_t* cu = static_cast<const idx_t*>(p.cu_seq);
  const int64_t base = (int64_t)blockIdx.x * kTile;
  for (int i = 0; i < kItems; ++i) {
    const int k = i * kThreads + threadIdx.x;
    const int64_t t = base + k;
    const bool m = t < p.T && p.mask[t];
    s_m[pad(k)] = m;
    s_r[pad(k)] = m ? p.rew[t] : 0.f;  // only trainable positions are read
    s_v[pad(k)] = m ? p.val[t] : 0.f;
  }
  __syncthreads();
  // this thread's tokens [t0, t1), walked backwards; s tracks the segment of t
  const int k0 = threadIdx.x * kItems;
  const int64_t t0 = base + k0, t1 = t0 + kItems < p.T ? t0 + kItems : p.T;
  int64_t s = t1 > t0 ? upper_index(cu, p.S, t1 - 1) : 0;
  GaeMap m = identity_map();
  for (int64_t t = t1 - 1; t >= t0; --t) {
    while ((int64_t)cu[s] > t) --s;
    const SegParams sp = p.seg[s];
    if (sp.reset != 0.0 && t == (int64_t)cu[s + 1] - 1) push_reset(m);
    const int k = pad((int)(t - base));
    if (s_m[k]) push_token(m, s_r[k], s_v[k], p.gamma, sp.gl, sp.glc);
  }
  s_map[threadIdx.x] = m;
  __syncthreads();
  for (int d = 1; d < kThreads; d <<= 1) {
    GaeMap x = s_map[threadIdx.x];
    if ((int)threadIdx.x + d < kThreads) x = then(s_map[threadIdx.x + d], x);
    __syncthreads();
    s_map[threadIdx.x] = x;
    __syncthreads();
  }
  if (!WRITE) {
    if (threadIdx.x == 0) p.maps[blockIdx.x] = s_map[0];
    return;
  }
  GaeState in = p.carry ? p.carry[blockIdx.x] : GaeState{};
  if ((int)threadIdx.x + 1 < kThreads) in = apply(s_map[threadIdx.x + 1], in);
  // the CPU kernel's recurrence from the exact carry-in
  GaeCarry c, cc;
  c.a_next = in.a, c.v_next = in.v;
  cc.a_next = in.ac, cc.v_next = in.v;
  const bool own_critic = p.lam_critic >= 0.0;
  s = t1 > t0 ? upper_index(cu, p.S, t1 - 1) : 0;
  for (int64_t t = t1 - 1; t >= t0; --t) {
    while ((int64_t)cu[s] > t) --s;
    const SegParams sp = p.seg[s];
    if (sp.reset != 0.0 && t == (int64_t)cu[s + 1] - 1) c = GaeCarry(), cc = GaeCarry();
    const int k = pad((int)(t - base));
    if (!s_m[k]) {
      s_r[k] = s_v[k] = 0.f;  // adv and ret are zero at non-trainable positions
      continue;
    }
    const double rt = s_r[k], vt = s_v[k];
    const double a = gae_step(c, rt, vt, p.gamma, sp.gl);
    s_r[k] = (float)(sp.scale * a);
    s_v[k] = (float)((own_critic ? gae_step(cc, rt, vt, p.gamma, sp.glc) : a) + vt);
  }
  __syncthreads();
  for (int i = 0; i < kItems; ++i) {
    const int k = i * kThreads + threadIdx.x;
    const int64_t t = base + k;
    if (t < p.T) {
      p.adv[t] = s_r[pad(k)];
      p.ret[t] = s_v[pad(k)];
    }
  }
}

// One block: carry[c] = maps[c+1] after maps[c+2] after ... (applied to the zero state), kThreads tiles
// at a time from the last; lane i handles tile c = last - i and starts from the map of tile c + 1.
__global__ void __launch_bounds__(kThreads) carry_kernel(Params p, int64_t n) {
  __shared__ GaeMap s_map[kThreads];
  __shared__ GaeState s_in;
  if (threadIdx.x == 0) s_in = GaeState{};
  for (int64_t c0 = n - 1; c0 >= 0; c0 -= kThreads) {
    const int64_t c = c0 - (int64_t)threadIdx.x;
    GaeMap x = (c >= 0 && c + 1 < n) ? p.maps[c + 1] : identity_map();  // identity past the ends
    s_map[threadIdx.x] = x;
    __syncthreads();
    for (int d = 1; d < kThreads; d <<= 1) {  // inclusive scan: lane i = its map after lanes i-1 .. 0
      if ((int)threadIdx.x >= d) x = then(s_map[threadIdx.x - d], x);
      __syncthreads();
      s_map[threadIdx.x] = x;
      __syncthreads();
    }
    const GaeState in = s_in;
    if (c >= 0) p.carry[c] = apply(x, in);
    __syncthreads();
    if (threadIdx.x == kThreads - 1) s_in = apply(x, in);  // identities past tile 0: the last lane carries on
    __syncthreads();
  }
}

template <typename idx_t>
void launch_t(const Params& p, cudaStream_t stream) {
  if (p.T == 0) return;
  if (p.counts) {
    auto k = count_kernel<idx_t>;
    CRF_LAUNCH(k, (unsigned)p.S, kThreads, stream, p);
  }
  auto seg = segment_kernel<idx_t>;
  CRF_LAUNCH(seg, (unsigned)((p.R + kThreads - 1) / kThreads), kThreads, stream, p);
  const int64_t nt = n_tiles(p.T);
  Params q = p;
  if (nt > 1) {
    auto summarise = tile_kernel<idx_t, false>;
    CRF_LAUNCH(summarise, (unsigned)nt, kThreads, stream, p);
    CRF_LAUNCH(carry_kernel, 1u, kThreads, stream, p, nt);
  } else {
    q.carry = nullptr;  // one tile: it starts from the zero state
  }
  auto write = tile_kernel<idx_t, true>;
  CRF_LAUNCH(write, (unsigned)nt, kThreads, stream, q);
}

// Host launcher (non-template: it instantiates every kernel, so this file compiles to a full cubin).
// Scratch sizes: counts [S] (only if p.counts), seg [S], maps and carry [n_tiles(T)].
void launch(const Params& p, bool cu_is_int64, cudaStream_t stream) {
  if (cu_is_int64) launch_t<int64_t>(p, stream);
  else launch_t<int32_t>(p, stream);
}

}  // namespace gae_cuda
}  // namespace crf
