// segment_gae on CPU, double accumulation. Schema and Python-facing semantics: compactionrl_fast/ops/gae.py;
// math: csrc/common/gae_step.h.
//   1. per rollout (in parallel): trainable counts and the per-segment numbers (crf::rollout_params);
//   2. the scan over "chains", the independent recurrences (a segment, or a stitched rollout): 8 (AVX-512) or 4
//      (AVX2, scalar) chains walk backwards in lockstep, one token of each per step, so the per-token
//      dependency chain of one recurrence overlaps with the others' instead of setting the pace. Masked tokens
//      are selects, not branches (a random mask would mispredict). A thread takes a range of chains; lanes stay
//      in lockstep while two or more are busy, and a chain long enough to outlast the others is cut into
//      pieces scanned in two passes (`cut_long_chains`).
// `segment_gae_serial` keeps the one-rollout-at-a-time scan for the benchmark's "old" row.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "../common/alloc.h"
#include "../common/count.h"
#include "../common/gae_step.h"

namespace {

using crf::GaeCarry;
using crf::SegParams;

// The per-segment numbers of rollout r: counts (when a mode needs them), then crf::rollout_params.
template <typename idx_t>
void rollout_numbers(int64_t r, const idx_t* cu_seq, const idx_t* cu_seg, const int64_t* start, const bool* mask,
                     const float* lam_seg, double gamma, double lam, int64_t lam_mode, double alpha, int64_t cross,
                     double lam_critic, int64_t* counts, SegParams* params) {
  const int64_t s0 = cu_seg[r], s1 = cu_seg[r + 1];
  const bool need_counts = cross == crf::kCrossPaper || lam_mode == crf::kLamAdaptiveSegment ||
                           lam_mode == crf::kLamAdaptiveRollout;
  if (need_counts)
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t b = start ? start[s] : (int64_t)cu_seq[s], e = b + (cu_seq[s + 1] - cu_seq[s]);
      counts[s] = crf::count_true(mask, b, e);
    }
  crf::rollout_params<idx_t>(s0, s1, cu_seq, need_counts ? counts : nullptr, lam_seg, gamma, lam, lam_mode, alpha,
                             cross, lam_critic, params);
}

// One rollout, segments [s0, s1): its per-segment numbers (`rollout_numbers`), then one reverse pass that reads
// only those numbers. Segment s holds the tokens [b, b + len) with len = cu_seq[s+1] - cu_seq[s] and
// b = start[s] (segments placed anywhere, e.g. the rows of a padded batch), or b = cu_seq[s] when start is null.
template <typename idx_t>
void gae_rollout(int64_t r, const idx_t* cu_seq, const idx_t* cu_seg, const int64_t* start, const float* rew,
                 const float* val, const bool* mask, const float* lam_seg, double gamma, double lam,
                 int64_t lam_mode, double alpha, int64_t cross, double lam_critic, int64_t* counts,
                 SegParams* params, float* adv, float* ret) {
  const int64_t s0 = cu_seg[r], s1 = cu_seg[r + 1];
  auto first = [&](int64_t s) -> int64_t { return start ? start[s] : (int64_t)cu_seq[s]; };
  rollout_numbers<idx_t>(r, cu_seq, cu_seg, start, mask, lam_seg, gamma, lam, lam_mode, alpha, cross, lam_critic,
                         counts, params);
  const bool own_critic = lam_critic >= 0.0;
  GaeCarry c, cc;  // advantage and critic (returns) recurrences
  for (int64_t s = s1 - 1; s >= s0; --s) {
    const SegParams sp = params[s];
    if (sp.reset != 0.0) c = GaeCarry(), cc = GaeCarry();
    const int64_t b = first(s);
    for (int64_t t = b + (cu_seq[s + 1] - cu_seq[s]) - 1; t >= b; --t) {
      if (!mask[t]) {
        adv[t] = 0.f;
        ret[t] = 0.f;
        continue;
      }
      const double rt = rew[t], vt = val[t];
      const double a = crf::gae_step(c, rt, vt, gamma, sp.gl);
      adv[t] = (float)(sp.scale * a);
      ret[t] = (float)((own_critic ? crf::gae_step(cc, rt, vt, gamma, sp.glc) : a) + vt);
    }
  }
}

// An independent recurrence: segments lo..hi walked from hi down; only hi has reset = 1. A piece of a long
// chain (`cut_long_chains`) starts at `end` - 1 in hi and stops at `begin` in lo, from the carry (a0, ac0, v0).
struct Chain {
  int64_t lo, hi;
  int64_t tokens = 0;  // set once the chain is complete
  int64_t begin = -1, end = -1;  // token bounds in lo and hi; -1: the whole segment
  double a0 = 0.0, ac0 = 0.0, v0 = 0.0;
  int64_t id = -1;  // >= 0: the state at its first token goes to ChainScan::finals[id]
  bool write = true;  // false: only that state is wanted (pass 1 of a piece that pass 2 scans again)
};

// The SIMD paths, chosen per call: COMPACTIONRL_FAST_CPU_SIMD = auto (default: the widest the CPU has),
// avx512, avx2 or none (asking for more than the CPU has gives what it has). Every path does the same
// float64 arithmetic per token (fused multiply-adds included), so they give the same bits.
enum Simd { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

Simd simd_path() {
  static const Simd have = __builtin_cpu_supports("avx512f") ? kAvx512
                           : (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) ? kAvx2
                                                                                               : kScalar;
  const char* v = std::getenv("COMPACTIONRL_FAST_CPU_SIMD");
  if (v == nullptr || *v == 0 || std::strcmp(v, "auto") == 0 || std::strcmp(v, "avx512") == 0) return have;
  if (std::strcmp(v, "avx2") == 0) return std::min(kAvx2, have);
  TORCH_CHECK_VALUE(std::strcmp(v, "none") == 0, "COMPACTIONRL_FAST_CPU_SIMD must be auto, avx512, avx2 or none, got '",
                    v, "'");
  return kScalar;
}

#define CRF_FMA __attribute__((target("avx2,fma")))
#define CRF_AVX512 __attribute__((target("avx512f,avx2,fma")))

constexpr int kMaxLanes = 8;

// One reverse step of one recurrence at token t, the arithmetic of every path: m = trainable, carries a
// (advantage), ac (critic), vn (the next trainable value). Written with std::fma so that the scalar code does
// what the vector code does (inlined into CRF_FMA functions it is one instruction). W = false: the carries only.
template <bool W>
[[gnu::always_inline]] inline void step(bool m, float rf, float vf, double g, double gl, double glc, double sc,
                                        double& a, double& ac, double& vn, float& adv, float& ret) {
  const double r = rf, v = vf;
  const double d = std::fma(g, vn, r) - v;
  const double an = std::fma(gl, a, d), acn = std::fma(glc, ac, d);
  if (W) {
    adv = m ? (float)(sc * an) : 0.f;
    ret = m ? (float)(acn + v) : 0.f;
  }
  a = m ? an : a;
  ac = m ? acn : ac;
  vn = m ? v : vn;
}

template <typename idx_t>
struct ChainScan {
  const idx_t* cu;
  const int64_t* start;
  const SegParams* P;
  const float *rew, *val;
  const bool* mask;
  double gamma;
  bool own_critic;
  float *adv, *ret;
  Simd simd;
  crf::GaeState* finals;  // pass 1 of `cut_long_chains`: the state each piece leaves at its first token

  int64_t first(int64_t s) const { return start ? start[s] : (int64_t)cu[s]; }
  int64_t len(int64_t s) const { return (int64_t)cu[s + 1] - (int64_t)cu[s]; }

  // One lane: its chain's segment s (>= lo), token p going down to b, the segment's numbers and the carries.
  struct Lane {
    int64_t s, lo, hi, p, b, begin, end, id;
    double gl, glc, scale, a, ac, vn;
    bool write;
  };

  // The tokens [b, e) of segment s in a chain (or piece) lo..hi whose bounds in lo and hi are begin, end (-1: none).
  std::pair<int64_t, int64_t> span(int64_t s, int64_t lo, int64_t hi, int64_t begin, int64_t end) const {
    const int64_t b = first(s);
    return {s == lo && begin >= 0 ? begin : b, s == hi && end >= 0 ? end : b + len(s)};
  }

  // Move `l` to the next non-empty segment at or below l.s; false when the chain is done.
  bool enter(Lane& l) const {
    while (l.s >= l.lo && len(l.s) == 0) --l.s;
    if (l.s < l.lo) return false;
    const auto [b, e] = span(l.s, l.lo, l.hi, l.begin, l.end);
    l.b = b, l.p = e - 1;
    l.gl = P[l.s].gl, l.glc = own_critic ? P[l.s].glc : P[l.s].gl, l.scale = P[l.s].scale;
    return true;
  }

  bool start_chain(Lane& l, const Chain& c) const {
    l.s = l.hi = c.hi, l.lo = c.lo, l.begin = c.begin, l.end = c.end, l.id = c.id, l.write = c.write;
    l.a = c.a0, l.ac = c.ac0, l.vn = c.v0;
    if (enter(l)) return true;
    done(l);
    return false;
  }

  void done(const Lane& l) const {
    if (l.id >= 0) finals[l.id] = crf::GaeState{l.a, l.vn, l.ac};
  }

  // The rest of one lane's chain on its own (the batch's last chains, or a single long one).
  template <bool W>
  [[gnu::always_inline]] inline void finish_body(Lane& l) const {
    do {
      double a = l.a, ac = l.ac, vn = l.vn;
      for (int64_t t = l.p; t >= l.b; --t)
        step<W>(mask[t], rew[t], val[t], gamma, l.gl, l.glc, l.scale, a, ac, vn, adv[t], ret[t]);
      l.a = a, l.ac = ac, l.vn = vn;
      --l.s;
    } while (enter(l));
    done(l);
  }
  template <bool W>
  CRF_FMA void finish_fma(Lane& l) const { finish_body<W>(l); }
  template <bool W>
  void finish_w(Lane& l) const { simd == kScalar ? finish_body<W>(l) : finish_fma<W>(l); }
  void finish(Lane& l) const { l.write ? finish_w<true>(l) : finish_w<false>(l); }

  // `n` lanes in lockstep for `steps` tokens each, one token of every lane per step: the lanes' recurrences
  // are independent, so their latencies overlap.
  template <bool W>
  [[gnu::always_inline]] inline void lockstep_body(int n, double* a, double* ac, double* vn, const double* gl,
                                                   const double* glc, const double* sc, const int64_t* p, int64_t i0,
                                                   int64_t i1) const {
    for (int64_t i = i0; i < i1; ++i)
      for (int k = 0; k < n; ++k) {
        const int64_t t = p[k] - i;
        step<W>(mask[t], rew[t], val[t], gamma, gl[k], glc[k], sc[k], a[k], ac[k], vn[k], adv[t], ret[t]);
      }
  }
  template <bool W>
  CRF_FMA void lockstep_fma(int n, double* a, double* ac, double* vn, const double* gl, const double* glc,
                            const double* sc, const int64_t* p, int64_t i0, int64_t i1) const {
    lockstep_body<W>(n, a, ac, vn, gl, glc, sc, p, i0, i1);
  }

  // AVX2: 4 lanes x 4 tokens per iteration. Each lane's 4 tokens are loaded contiguously and transposed, so
  // that one __m256d holds one step of the 4 lanes; results are transposed back and stored. Returns the steps
  // done (a multiple of 4). W = false: the carries only.
  template <bool W>
  CRF_FMA int64_t lockstep_avx2(double* a_, double* ac_, double* vn_, const double* gl_, const double* glc_,
                                const double* sc_, const int64_t* p, int64_t steps) const {
    __m256d a = _mm256_loadu_pd(a_), ac = _mm256_loadu_pd(ac_), vn = _mm256_loadu_pd(vn_);
    const __m256d gl = _mm256_loadu_pd(gl_), glc = _mm256_loadu_pd(glc_), sc = _mm256_loadu_pd(sc_);
    const __m256d g = _mm256_set1_pd(gamma), zero_d = _mm256_setzero_pd();
    int64_t i = 0;
    for (; i + 4 <= steps; i += 4) {
      // rows: lane k's tokens p[k]-i-3 .. p[k]-i
      __m128 r0 = _mm_loadu_ps(rew + p[0] - i - 3), r1 = _mm_loadu_ps(rew + p[1] - i - 3);
      __m128 r2 = _mm_loadu_ps(rew + p[2] - i - 3), r3 = _mm_loadu_ps(rew + p[3] - i - 3);
      __m128 v0 = _mm_loadu_ps(val + p[0] - i - 3), v1 = _mm_loadu_ps(val + p[1] - i - 3);
      __m128 v2 = _mm_loadu_ps(val + p[2] - i - 3), v3 = _mm_loadu_ps(val + p[3] - i - 3);
      _MM_TRANSPOSE4_PS(r0, r1, r2, r3);  // now r_c: column c (token p-i-3+c) of every lane
      _MM_TRANSPOSE4_PS(v0, v1, v2, v3);
      int32_t mb[4];
      for (int k = 0; k < 4; ++k) std::memcpy(&mb[k], mask + p[k] - i - 3, 4);
      // the mask bytes of column c at bytes 4c..4c+3, as 0 / -1, so that sign-extending them gives blend masks
      const __m128i mcols = _mm_sub_epi8(_mm_setzero_si128(), _mm_shuffle_epi8(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(mb)),
          _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15)));
      const __m128 rc[4] = {r0, r1, r2, r3}, vc[4] = {v0, v1, v2, v3};
      const __m256d mc[4] = {_mm256_castsi256_pd(_mm256_cvtepi8_epi64(mcols)),
                             _mm256_castsi256_pd(_mm256_cvtepi8_epi64(_mm_srli_si128(mcols, 4))),
                             _mm256_castsi256_pd(_mm256_cvtepi8_epi64(_mm_srli_si128(mcols, 8))),
                             _mm256_castsi256_pd(_mm256_cvtepi8_epi64(_mm_srli_si128(mcols, 12)))};
      __m128 oa[4], orr[4];
      for (int c = 3; c >= 0; --c) {  // backwards: token p-i first
        const __m256d m = mc[c];
        const __m256d r = _mm256_cvtps_pd(rc[c]), v = _mm256_cvtps_pd(vc[c]);
        const __m256d d = _mm256_sub_pd(_mm256_fmadd_pd(g, vn, r), v);
        const __m256d an = _mm256_fmadd_pd(gl, a, d);
        const __m256d acn = _mm256_fmadd_pd(glc, ac, d);
        if (W) {
          oa[c] = _mm256_cvtpd_ps(_mm256_blendv_pd(zero_d, _mm256_mul_pd(sc, an), m));
          orr[c] = _mm256_cvtpd_ps(_mm256_blendv_pd(zero_d, _mm256_add_pd(acn, v), m));
        }
        a = _mm256_blendv_pd(a, an, m);
        ac = _mm256_blendv_pd(ac, acn, m);
        vn = _mm256_blendv_pd(vn, v, m);
      }
      if (W) {
        _MM_TRANSPOSE4_PS(oa[0], oa[1], oa[2], oa[3]);  // back to rows: lane k's 4 tokens
        _MM_TRANSPOSE4_PS(orr[0], orr[1], orr[2], orr[3]);
        for (int k = 0; k < 4; ++k) {
          _mm_storeu_ps(adv + p[k] - i - 3, oa[k]);
          _mm_storeu_ps(ret + p[k] - i - 3, orr[k]);
        }
      }
    }
    _mm256_storeu_pd(a_, a), _mm256_storeu_pd(ac_, ac), _mm256_storeu_pd(vn_, vn);
    return i;
  }

  // 8 x 8 floats: rows in, columns out.
  CRF_AVX512 [[gnu::always_inline]] static inline void transpose8(__m256* x) {
    __m256 t[8], u[8];
    for (int k = 0; k < 8; k += 2) t[k] = _mm256_unpacklo_ps(x[k], x[k + 1]), t[k + 1] = _mm256_unpackhi_ps(x[k], x[k + 1]);
    for (int k = 0; k < 8; k += 4) {
      u[k] = _mm256_shuffle_ps(t[k], t[k + 2], 0x44), u[k + 1] = _mm256_shuffle_ps(t[k], t[k + 2], 0xEE);
      u[k + 2] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0x44), u[k + 3] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0xEE);
    }
    for (int k = 0; k < 4; ++k)
      x[k] = _mm256_permute2f128_ps(u[k], u[k + 4], 0x20), x[k + 4] = _mm256_permute2f128_ps(u[k], u[k + 4], 0x31);
  }

  // AVX-512: 8 lanes x 8 tokens per iteration, the same scheme with mask registers: a masked fused
  // multiply-add updates a carry only at trainable tokens, a zero-masked product writes 0 elsewhere.
  // OWN: the returns have their own recurrence (lam_critic); without it they are advantages + values.
  // W = false: the carries only.
  template <bool OWN, bool W>
  CRF_AVX512 int64_t lockstep_avx512(double* a_, double* ac_, double* vn_, const double* gl_, const double* glc_,
                                     const double* sc_, const int64_t* p, int64_t steps) const {
    __m512d a = _mm512_loadu_pd(a_), ac = _mm512_loadu_pd(ac_), vn = _mm512_loadu_pd(vn_);
    const __m512d gl = _mm512_loadu_pd(gl_), glc = _mm512_loadu_pd(glc_), sc = _mm512_loadu_pd(sc_);
    const __m512d g = _mm512_set1_pd(gamma);
    int64_t i = 0;
    for (; i + 8 <= steps; i += 8) {
      __m256 r[8], v[8], oa[8], orr[8];
      uint64_t mb[8];
      for (int k = 0; k < 8; ++k) {  // rows: lane k's tokens p[k]-i-7 .. p[k]-i
        r[k] = _mm256_loadu_ps(rew + p[k] - i - 7);
        v[k] = _mm256_loadu_ps(val + p[k] - i - 7);
        std::memcpy(&mb[k], mask + p[k] - i - 7, 8);
      }
      transpose8(r);  // r[c]: column c (token p-i-7+c) of every lane
      transpose8(v);
      const __m512i mq = _mm512_loadu_si512(mb);  // lane k's mask bytes in qword k: column c is byte c
      for (int c = 7; c >= 0; --c) {  // backwards: token p-i first
        const __mmask8 m = _mm512_test_epi64_mask(mq, _mm512_set1_epi64(1ll << (8 * c)));
        const __m512d rd = _mm512_cvtps_pd(r[c]), vd = _mm512_cvtps_pd(v[c]);
        const __m512d d = _mm512_sub_pd(_mm512_fmadd_pd(g, vn, rd), vd);
        a = _mm512_mask_fmadd_pd(a, m, gl, d);  // a * gl + d == fma(gl, a, d)
        if (OWN) ac = _mm512_mask_fmadd_pd(ac, m, glc, d);
        else ac = a;
        vn = _mm512_mask_mov_pd(vn, m, vd);
        if (W) {
          oa[c] = _mm512_cvtpd_ps(_mm512_maskz_mul_pd(m, sc, a));
          orr[c] = _mm512_cvtpd_ps(_mm512_maskz_add_pd(m, ac, vd));
        }
      }
      if (W) {
        transpose8(oa);  // back to rows: lane k's 8 tokens
        transpose8(orr);
        for (int k = 0; k < 8; ++k) {
          _mm256_storeu_ps(adv + p[k] - i - 7, oa[k]);
          _mm256_storeu_ps(ret + p[k] - i - 7, orr[k]);
        }
      }
    }
    _mm512_storeu_pd(a_, a), _mm512_storeu_pd(ac_, ac), _mm512_storeu_pd(vn_, vn);
    return i;
  }

  // `n` live lanes (2 <= n <= lanes) for `steps` tokens each. A vector path always computes all its lanes: the
  // lanes past n repeat lane 0 exactly (its tokens, carries and numbers), so they store lane 0's bytes again.
  template <bool W>
  void lockstep(Lane* lane, int n, int lanes, int64_t steps) const {
    double a[kMaxLanes], ac[kMaxLanes], vn[kMaxLanes], gl[kMaxLanes], glc[kMaxLanes], sc[kMaxLanes];
    int64_t p[kMaxLanes];
    for (int k = 0; k < lanes; ++k) {
      const Lane& l = lane[k < n ? k : 0];
      a[k] = l.a, ac[k] = l.ac, vn[k] = l.vn, gl[k] = l.gl, glc[k] = l.glc, sc[k] = l.scale, p[k] = l.p;
    }
    int64_t done = 0;
    if (simd == kAvx512)
      done = own_critic ? lockstep_avx512<true, W>(a, ac, vn, gl, glc, sc, p, steps)
                        : lockstep_avx512<false, W>(a, ac, vn, gl, glc, sc, p, steps);
    else if (simd == kAvx2) done = lockstep_avx2<W>(a, ac, vn, gl, glc, sc, p, steps);
    if (simd == kScalar) lockstep_body<W>(n, a, ac, vn, gl, glc, sc, p, done, steps);
    else lockstep_fma<W>(n, a, ac, vn, gl, glc, sc, p, done, steps);
    for (int k = 0; k < n; ++k) lane[k].a = a[k], lane[k].ac = ac[k], lane[k].vn = vn[k], lane[k].p = p[k] - steps;
  }

  void run(const Chain* chains_in, int64_t n) const {
    const int lanes = simd == kAvx512 ? 8 : 4;
    // longest first: when the queue runs dry, the lanes still busy hold the shortest chains; pieces that only
    // leave their state before those that write, so that they fill the lanes by themselves
    std::vector<Chain> chains(chains_in, chains_in + n);
    std::stable_sort(chains.begin(), chains.end(), [](const Chain& x, const Chain& y) {
      return x.write != y.write ? y.write : x.tokens > y.tokens;
    });
    Lane lane[kMaxLanes];
    int64_t next = 0;
    int live = 0;
    for (; live < lanes && next < n;)
      if (start_chain(lane[live], chains[next++])) ++live;
    // lanes in lockstep while two or more are busy (one alone is faster on its own: no transposes)
    while (live >= 2) {
      int64_t steps = lane[0].p - lane[0].b + 1;
      for (int k = 1; k < live; ++k) steps = std::min(steps, lane[k].p - lane[k].b + 1);
      // lanes that only leave their state skip the outputs when no lane writes (Chain::write); otherwise
      // they write too, outputs that pass 2 writes again
      bool write = false;
      for (int k = 0; k < live; ++k) write |= lane[k].write;
      write ? lockstep<true>(lane, live, lanes, steps) : lockstep<false>(lane, live, lanes, steps);
      for (int k = 0; k < live;) {
        if (lane[k].p >= lane[k].b) {
          ++k;
          continue;
        }
        --lane[k].s;
        if (enter(lane[k])) continue;
        done(lane[k]);
        bool refilled = false;
        while (!refilled && next < n) refilled = start_chain(lane[k], chains[next++]);
        if (!refilled) lane[k] = lane[--live];  // the queue is empty: the last lane moves here
      }
    }
    for (int k = 0; k < live; ++k) finish(lane[k]);
    for (; next < n; ++next) {
      Lane l;
      if (start_chain(l, chains[next])) finish(l);
    }
  }
};

// Runs `list` on the threads: ranges of chains of about equal token counts, one per task (~32K tokens at least:
// waking a pool thread costs more than scanning a small batch, and on a loaded machine a scheduler time slice).
template <typename idx_t>
void run_parallel(const ChainScan<idx_t>& scan, const std::vector<Chain>& list) {
  std::vector<int64_t> acc(1, 0);  // prefix sums of the chains' lengths
  for (const Chain& c : list) acc.push_back(acc.back() + c.tokens);
  const int64_t n = (int64_t)list.size(), total = acc.back();
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total / 32768));
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      auto at_share = [&](int64_t j) {
        return (int64_t)(std::lower_bound(acc.begin(), acc.end(), total * j / tasks) - acc.begin());
      };
      const int64_t c0 = std::min(at_share(k), n), c1 = k + 1 == tasks ? n : std::min(at_share(k + 1), n);
      if (c1 > c0) scan.run(list.data() + c0, c1 - c0);
    }
  });
}

// Long chains, cut into pieces. A chain of more than max(32K, T/8) tokens would leave the lanes idle while one
// lane walks it one dependent step at a time, so it is cut into pieces of about max(16K, T/16) tokens. Pass 1
// (`first`) runs every piece but a chain's earliest from a zero carry and keeps the state at its first token
// (writing only the chain's last piece, whose zero carry is its true one; the others skip their outputs'
// conversions, transposes and stores); with the products of gamma*lam over each piece's trainable tokens these
// states give every piece's carry (`carry_pieces`, float64). Pass 2 (`second`) runs the chains left whole and
// every piece but a chain's last. The cut depends only on the layout, so the result does not depend on the
// thread count or the vector width.
struct Cut {
  std::vector<Chain> first, second;
  // per cut chain and piece k (earliest first): its index in `first` (-1 for k = 0) and in `second` (-1 for the last)
  std::vector<std::vector<int64_t>> pieces, in_second;
};

template <typename idx_t>
Cut cut_long_chains(const ChainScan<idx_t>& scan, const std::vector<Chain>& chains, int64_t T) {
  Cut cut;
  const int64_t piece = std::max<int64_t>(16384, T / 16);
  for (const Chain& c : chains) {
    if (c.tokens <= 2 * piece) {
      cut.second.push_back(c);
      continue;
    }
    const int64_t m = (c.tokens + piece - 1) / piece;
    // chain offset o (tokens of segments lo.. in order) -> its segment and position, for increasing o; cuts
    // fall on tokens, so every piece's first and last segment hold some of its tokens
    int64_t s = c.lo, before = 0;  // tokens of the chain before segment s
    auto locate = [&](int64_t o) {
      while (before + scan.len(s) <= o) before += scan.len(s++);
      return std::pair<int64_t, int64_t>{s, scan.first(s) + (o - before)};
    };
    std::vector<int64_t> ids(m, -1), in_second(m, -1);
    for (int64_t k = 0; k < m; ++k) {
      const int64_t o0 = c.tokens * k / m, o1 = c.tokens * (k + 1) / m;
      const auto [s0, b0] = locate(o0);
      Chain p{s0, c.hi, o1 - o0};
      p.begin = b0;
      if (k + 1 < m) {  // ends after its last token
        const auto [s1, b1] = locate(o1 - 1);
        p.hi = s1, p.end = b1 + 1;
      }
      if (k > 0) {
        p.id = (int64_t)cut.first.size(), ids[k] = p.id;
        p.write = k + 1 == m;  // the others are scanned again in pass 2: their state is all pass 1 needs
        cut.first.push_back(p);
        p.id = -1, p.write = true;
      }
      if (k + 1 < m) in_second[k] = (int64_t)cut.second.size(), cut.second.push_back(p);
    }
    cut.pieces.push_back(ids);
    cut.in_second.push_back(in_second);
  }
  return cut;
}

// Each piece's carry, from the chain's end backwards: the state entering piece k (from the later side) through
// piece k's map gives the state entering piece k-1. The map: the products of gamma*lam (critic: gamma*lam_critic)
// over the piece's trainable tokens (xa; ya: gamma times all but the latest one's, where the carried value enters;
// crf::power_count per segment, float64), and pass 1's state from a zero carry.
template <typename idx_t>
void carry_pieces(const ChainScan<idx_t>& scan, Cut& cut, const std::vector<crf::GaeState>& finals) {
  for (size_t j = 0; j < cut.pieces.size(); ++j) {
    const std::vector<int64_t>& ids = cut.pieces[j];
    crf::GaeState carry{0.0, 0.0, 0.0};
    for (size_t k = ids.size() - 1; k >= 1; --k) {
      const Chain& p = cut.first[ids[k]];
      int64_t latest = -1;
      std::vector<int64_t> n(p.hi - p.lo + 1);
      for (int64_t s = p.lo; s <= p.hi; ++s) {
        const auto [b, e] = scan.span(s, p.lo, p.hi, p.begin, p.end);
        if ((n[s - p.lo] = crf::count_true(scan.mask, b, e))) latest = s;
      }
      double xa = 1.0, ya = scan.gamma, xc = 1.0, yc = scan.gamma;
      for (int64_t s = p.lo; s <= p.hi; ++s) {
        const double gl = scan.P[s].gl, glc = scan.own_critic ? scan.P[s].glc : gl;
        const int64_t ns = n[s - p.lo], ny = ns - (s == latest);
        xa *= crf::power_count(gl, ns), ya *= crf::power_count(gl, ny);
        xc *= crf::power_count(glc, ns), yc *= crf::power_count(glc, ny);
      }
      const crf::GaeState& f = finals[ids[k]];
      const bool any = latest >= 0;
      carry = crf::GaeState{xa * carry.a + (any ? ya * carry.v : 0.0) + f.a, any ? f.v : carry.v,
                            xc * carry.ac + (any ? yc * carry.v : 0.0) + f.ac};
      Chain& q = cut.second[cut.in_second[j][k - 1]];
      q.a0 = carry.a, q.ac0 = carry.ac, q.v0 = carry.v;
    }
  }
}

// Offsets are checked here too (O(S + R)), since the op can be called without the Python checks (directly,
// or under torch.compile): a bad layout is a ValueError, never an out-of-bounds access.
template <typename idx_t>
void check_offsets(const idx_t* cu, int64_t n, int64_t total, const char* name, const char* total_name) {
  TORCH_CHECK_VALUE(n >= 1 && cu[0] == 0, "segment_gae: ", name, "[0] must be 0");
  for (int64_t i = 1; i < n; ++i)
    TORCH_CHECK_VALUE(cu[i] >= cu[i - 1], "segment_gae: ", name, " must be non-decreasing, but ", name, "[", i,
                      "]=", (int64_t)cu[i], " < ", name, "[", i - 1, "]=", (int64_t)cu[i - 1]);
  TORCH_CHECK_VALUE(cu[n - 1] == total, "segment_gae: ", name, "[-1] must equal ", total_name, "=", total, ", got ",
                    (int64_t)cu[n - 1]);
}

// Placed segments must tile [0, T): each [start, start + len) inside it, no two overlapping, none left out.
template <typename idx_t>
void check_starts(const int64_t* start, const idx_t* cu, int64_t S, int64_t T) {
  std::vector<std::pair<int64_t, int64_t>> iv(S);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t len = cu[s + 1] - cu[s];
    TORCH_CHECK_VALUE(start[s] >= 0 && start[s] <= T - len, "segment_gae: seg_start[", s, "]=", start[s],
                      " puts segment ", s, " (", len, " tokens) outside [0, T=", T, ")");
    iv[s] = {start[s], len};
  }
  std::sort(iv.begin(), iv.end());
  int64_t next = 0;
  for (const auto& [b, len] : iv) {
    if (len == 0) continue;
    TORCH_CHECK_VALUE(b == next, "segment_gae: the segments placed by seg_start must cover [0, T) without gaps or "
                      "overlaps; position ", std::min(b, next), " is ", b > next ? "in no segment" : "in two");
    next = b + len;
  }
  TORCH_CHECK_VALUE(next == T, "segment_gae: the segments placed by seg_start leave [", next, ", ", T, ") uncovered");
}

std::tuple<at::Tensor, at::Tensor> segment_gae_cpu(const at::Tensor& rewards, const at::Tensor& values,
                                                   const at::Tensor& loss_mask, const at::Tensor& cu_seqlens,
                                                   const at::Tensor& cu_segments,
                                                   const std::optional<at::Tensor>& lam_seg, double gamma,
                                                   double lam, int64_t lam_mode, double alpha, int64_t cross,
                                                   double lam_critic, const std::optional<at::Tensor>& seg_start,
                                                   bool serial = false) {
  TORCH_CHECK(rewards.device().is_cpu() && values.device().is_cpu() && loss_mask.device().is_cpu() &&
                  cu_seqlens.device().is_cpu() && cu_segments.device().is_cpu(),
              "segment_gae: all tensors must be on the CPU");
  TORCH_CHECK(rewards.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat,
              "segment_gae: rewards and values must be float32");
  TORCH_CHECK(loss_mask.scalar_type() == at::kBool, "segment_gae: loss_mask must be bool");
  TORCH_CHECK(cu_seqlens.scalar_type() == cu_segments.scalar_type(),
              "segment_gae: cu_seqlens and cu_segments must share a dtype");
  auto rew = rewards.contiguous(), val = values.contiguous(), mask = loss_mask.contiguous();
  auto cs = cu_seqlens.contiguous(), cg = cu_segments.contiguous();
  at::Tensor ls;
  const float* lam_ptr = nullptr;
  if (lam_mode == crf::kLamTensor) {
    TORCH_CHECK(lam_seg.has_value(), "segment_gae: lam_mode=tensor needs lam_seg");
    ls = lam_seg->to(at::kFloat).contiguous();
    lam_ptr = ls.data_ptr<float>();
  }
  TORCH_CHECK_VALUE(rew.numel() == mask.numel() && val.numel() == mask.numel(),
                    "segment_gae: rewards, values and loss_mask must all be [T]");
  TORCH_CHECK_VALUE(cs.dim() == 1 && cg.dim() == 1 && cs.numel() >= 1 && cg.numel() >= 1,
                    "segment_gae: cu_seqlens and cu_segments must be 1-D with at least one element");
  at::Tensor st;
  if (seg_start.has_value()) {
    TORCH_CHECK_TYPE(seg_start->scalar_type() == at::kLong && seg_start->device().is_cpu(),
                     "segment_gae: seg_start must be an int64 CPU tensor");
    st = seg_start->contiguous();
    TORCH_CHECK_VALUE(st.dim() == 1 && st.numel() == cs.numel() - 1, "segment_gae: seg_start must be [S]");
  }
  AT_DISPATCH_INDEX_TYPES(cs.scalar_type(), "segment_gae_cpu_check", [&] {
    check_offsets<index_t>(cs.data_ptr<index_t>(), cs.numel(), mask.numel(), "cu_seqlens", "T");
    check_offsets<index_t>(cg.data_ptr<index_t>(), cg.numel(), cs.numel() - 1, "cu_segments", "S");
    if (st.defined()) check_starts<index_t>(st.data_ptr<int64_t>(), cs.data_ptr<index_t>(), cs.numel() - 1, mask.numel());
  });
  if (lam_mode == crf::kLamTensor)
    TORCH_CHECK_VALUE(ls.numel() == cs.numel() - 1, "segment_gae: lam_seg must be [S]");
  auto adv = crf::empty_output(rew.sizes(), rew.options()), ret = crf::empty_output(rew.sizes(), rew.options());
  const int64_t R = cg.numel() - 1, S = cs.numel() - 1, T = rew.numel();
  std::vector<int64_t> counts(S);
  std::vector<SegParams> params(S);
  // ~32K tokens per task (ATen's grain): a small batch stays on the calling thread, since waking a pool
  // thread costs more than scanning it (and, on a loaded machine, a whole scheduler time slice).
  const int64_t grain = std::max<int64_t>(1, R * 32768 / std::max<int64_t>(T, 1));
  const int64_t* pst = st.defined() ? st.data_ptr<int64_t>() : nullptr;
  AT_DISPATCH_INDEX_TYPES(cs.scalar_type(), "segment_gae_cpu", [&] {
    const index_t* cu_seq = cs.data_ptr<index_t>();
    const index_t* cu_seg = cg.data_ptr<index_t>();
    const bool* pm = mask.data_ptr<bool>();
    if (serial) {
      const float *pr = rew.data_ptr<float>(), *pv = val.data_ptr<float>();
      float *pa = adv.data_ptr<float>(), *pt = ret.data_ptr<float>();
      at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
          gae_rollout<index_t>(r, cu_seq, cu_seg, pst, pr, pv, pm, lam_ptr, gamma, lam, lam_mode, alpha, cross,
                               lam_critic, counts.data(), params.data(), pa, pt);
      });
      return;
    }
    at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        rollout_numbers<index_t>(r, cu_seq, cu_seg, pst, pm, lam_ptr, gamma, lam, lam_mode, alpha, cross, lam_critic,
                                 counts.data(), params.data());
    });
    std::vector<Chain> chains;  // each starts (from the end) at a segment with reset = 1
    for (int64_t s = S - 1; s >= 0; --s) {
      if (params[s].reset != 0.0 || chains.empty()) chains.push_back({s, s, 0});
      else chains.back().lo = s;
    }
    for (Chain& c : chains) c.tokens = (int64_t)cu_seq[c.hi + 1] - (int64_t)cu_seq[c.lo];
    ChainScan<index_t> scan{cu_seq, pst, params.data(), rew.data_ptr<float>(), val.data_ptr<float>(), pm,
                            gamma, lam_critic >= 0.0, adv.data_ptr<float>(), ret.data_ptr<float>(), simd_path(),
                            nullptr};
    Cut cut = cut_long_chains(scan, chains, T);
    if (cut.first.empty()) return run_parallel(scan, chains);
    std::vector<crf::GaeState> finals(cut.first.size());
    scan.finals = finals.data();
    run_parallel(scan, cut.first);
    carry_pieces(scan, cut, finals);
    run_parallel(scan, cut.second);
  });
  return {adv, ret};
}

std::tuple<at::Tensor, at::Tensor> segment_gae_serial_cpu(const at::Tensor& rewards, const at::Tensor& values,
                                                          const at::Tensor& loss_mask, const at::Tensor& cu_seqlens,
                                                          const at::Tensor& cu_segments,
                                                          const std::optional<at::Tensor>& lam_seg, double gamma,
                                                          double lam, int64_t lam_mode, double alpha, int64_t cross,
                                                          double lam_critic, const std::optional<at::Tensor>& seg_start) {
  return segment_gae_cpu(rewards, values, loss_mask, cu_seqlens, cu_segments, lam_seg, gamma, lam, lam_mode, alpha,
                         cross, lam_critic, seg_start, true);
}

}  // namespace

TORCH_LIBRARY_IMPL(compactionrl_fast, CPU, m) {
  m.impl("segment_gae", [](const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& loss_mask,
                           const at::Tensor& cu_seqlens, const at::Tensor& cu_segments,
                           const std::optional<at::Tensor>& lam_seg, double gamma, double lam, int64_t lam_mode,
                           double alpha, int64_t cross, double lam_critic, const std::optional<at::Tensor>& seg_start) {
    return segment_gae_cpu(rewards, values, loss_mask, cu_seqlens, cu_segments, lam_seg, gamma, lam, lam_mode, alpha,
                           cross, lam_critic, seg_start, false);
  });
  m.impl("segment_gae_serial", &segment_gae_serial_cpu);
}
