// The CPU segment_gae scan (csrc/cpu/gae.cpp): independent recurrences ("chains": a segment, or a stitched
// rollout, from a segment with reset = 1 down) walked backwards in lockstep, 8 (AVX-512) or 4 (AVX2, scalar)
// at a time, one token of each per step, so that the per-token dependency chain of one recurrence overlaps with
// the others' instead of setting the pace. Masked tokens are selects, not branches (a random mask would
// mispredict). Included by gae.cpp only.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "../common/gae_step.h"

namespace crf {
namespace gae_cpu {

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

// The SIMD paths (crf::cpu_simd in gae.cpp picks one). Every path does the same float64 arithmetic per token
// (fused multiply-adds included), so they give the same bits.
enum Simd { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

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
  const crf::SegParams* P;
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

}  // namespace gae_cpu
}  // namespace crf
