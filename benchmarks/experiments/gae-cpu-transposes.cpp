// Experiment behind benchmarks/experiments/gae-cpu-transposes.md (not built, not part of the package): the AVX-512
// lockstep scan of csrc/cpu/gae.cpp (no own critic) on 8 chains of L tokens, with variants that leave out parts of
// the data movement. V0: as shipped (8x8 float transposes of rewards and values in, advantages and returns out);
// V1: no transposes at all (wrong results, timing only); V3: the inputs through 512-bit two-source permutes
// (vpermt2ps) instead, same results; V4: no input transposes; V5: no output transposes (both timing only).
// V6: the same scan in float32 with 16 chains per 512-bit vector (16x16 transposes; the mask bytes regrouped by
// two-source byte permutes so that one test gives 4 columns' masks; checked bit for bit against a scalar float32
// loop of the same operations); V7: V6 without transposes; V8: V7 without masks; V11: V0 without masks (timing only).
//   g++ -O3 -o gae-cpu-transposes gae-cpu-transposes.cpp && ./gae-cpu-transposes 8229 300
// 16 chains of L tokens (V0-V5 take them 8 at a time). L = 8229, not 8192: chains 2^k floats apart put all 40 streams in the same L1 sets (0.92 ns/token for V0).
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <chrono>
#include <algorithm>
#define A512 __attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,avx512vbmi,avx2,fma,gfni")))
A512 static inline void transpose8(__m256* x) {
  __m256 t[8], u[8];
  for (int k = 0; k < 8; k += 2) t[k] = _mm256_unpacklo_ps(x[k], x[k + 1]), t[k + 1] = _mm256_unpackhi_ps(x[k], x[k + 1]);
  for (int k = 0; k < 8; k += 4) {
    u[k] = _mm256_shuffle_ps(t[k], t[k + 2], 0x44), u[k + 1] = _mm256_shuffle_ps(t[k], t[k + 2], 0xEE);
    u[k + 2] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0x44), u[k + 3] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k)
    x[k] = _mm256_permute2f128_ps(u[k], u[k + 4], 0x20), x[k + 4] = _mm256_permute2f128_ps(u[k], u[k + 4], 0x31);
}

struct Idx { int in1[2][16], in2[4][16]; };
// Z_k (k<4) pos q: lane k+4*(q/8), token q%8
// A0: tokens q/4 lanes L01[q%4] from (Z0,Z1); A1: tokens 4+q/4 same; A2: tokens q/4 lanes L23 from (Z2,Z3); A3
// W_m pos q: lane q%8, token 2m + q/8 ; W0,W1 from (A0,A2); W2,W3 from (A1,A3)
static Idx make_idx() {
  Idx x;  // A_h holds lanes {0,1,4,5} (from Z0,Z1) or {2,3,6,7} (from Z2,Z3)
  for (int h = 0; h < 2; ++h)  // A_h from (Z0,Z1) [h=0 -> A0, h=1 -> A1]; same index for A2/A3 from (Z2,Z3)
    for (int q = 0; q < 16; ++q) {
      int tok = 4*h + q/4, slot = q%4;  // lane L01[slot]: lane = slot%2 + 4*(slot/2) relative to Z pair
      int zsel = slot % 2, half = slot / 2;  // Z0/Z1 (or Z2/Z3), half 0 lanes 0..3, half 1 lanes 4..7
      x.in1[h][q] = zsel*16 + half*8 + tok;
    }
  for (int m = 0; m < 4; ++m)  // W_m from (A_{m/2}, A_{m/2+2})
    for (int q = 0; q < 16; ++q) {
      int lane = q % 8, tok = 2*m + q/8, tl = tok % 4;
      int inhi = (lane % 4) >= 2;  // lanes 2,3,6,7 -> second source
      int slot = (lane%2) + 2*(lane/4);
      x.in2[m][q] = inhi*16 + tl*4 + slot;
    }
  return x;
}
static const Idx IDX = make_idx();
A512 static inline void load_cols(const float* base, const int64_t* p, int64_t off, __m512d* col) {
  __m512 z[4];
  for (int k = 0; k < 4; ++k)
    z[k] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(base + p[k] - off)), _mm256_loadu_ps(base + p[k + 4] - off), 1);
  const __m512i i0 = _mm512_loadu_si512(IDX.in1[0]), i1 = _mm512_loadu_si512(IDX.in1[1]);
  __m512 a0 = _mm512_permutex2var_ps(z[0], i0, z[1]), a1 = _mm512_permutex2var_ps(z[0], i1, z[1]);
  __m512 a2 = _mm512_permutex2var_ps(z[2], i0, z[3]), a3 = _mm512_permutex2var_ps(z[2], i1, z[3]);
  __m512 w[4];
  w[0] = _mm512_permutex2var_ps(a0, _mm512_loadu_si512(IDX.in2[0]), a2);
  w[1] = _mm512_permutex2var_ps(a0, _mm512_loadu_si512(IDX.in2[1]), a2);
  w[2] = _mm512_permutex2var_ps(a1, _mm512_loadu_si512(IDX.in2[2]), a3);
  w[3] = _mm512_permutex2var_ps(a1, _mm512_loadu_si512(IDX.in2[3]), a3);
  for (int m = 0; m < 4; ++m) {
    col[2*m] = _mm512_cvtps_pd(_mm512_castps512_ps256(w[m]));
    col[2*m+1] = _mm512_cvtps_pd(_mm512_extractf32x8_ps(w[m], 1));
  }
}
struct S { const float *rew, *val; const bool* mask; float *adv, *ret; double gamma; };
template <int V>
A512 __attribute__((noinline)) int64_t lockstep(const S& s, double* a_, double* ac_, double* vn_, const double* gl_, const double* glc_,
                                     const double* sc_, const int64_t* p, int64_t steps) {
  const float* rew = s.rew; const float* val = s.val; const bool* mask = s.mask; float* adv = s.adv; float* ret = s.ret;
  __m512d a = _mm512_loadu_pd(a_), ac = _mm512_loadu_pd(ac_), vn = _mm512_loadu_pd(vn_);
  const __m512d gl = _mm512_loadu_pd(gl_), glc = _mm512_loadu_pd(glc_), sc = _mm512_loadu_pd(sc_);
  const __m512d g = _mm512_set1_pd(s.gamma);
  int64_t i = 0;
  for (; i + 8 <= steps; i += 8) {
    __m256 r[8], v[8], oa[8], orr[8];

    if (V == 3) {
      __m512d rc[8], vc[8];
      load_cols(rew, p, i + 7, rc);
      load_cols(val, p, i + 7, vc);
      uint64_t mb2[8];
      for (int k = 0; k < 8; ++k) std::memcpy(&mb2[k], mask + p[k] - i - 7, 8);
      const __m512i mq = _mm512_loadu_si512(mb2);
      for (int c = 7; c >= 0; --c) {
        const __mmask8 m = _mm512_test_epi64_mask(mq, _mm512_set1_epi64(1ll << (8 * c)));
        const __m512d rd = rc[c], vd = vc[c];
        const __m512d d = _mm512_sub_pd(_mm512_fmadd_pd(g, vn, rd), vd);
        a = _mm512_mask_fmadd_pd(a, m, gl, d);
        ac = a;
        vn = _mm512_mask_mov_pd(vn, m, vd);
        oa[c] = _mm512_cvtpd_ps(_mm512_maskz_mul_pd(m, sc, a));
        orr[c] = _mm512_cvtpd_ps(_mm512_maskz_add_pd(m, ac, vd));
      }
      transpose8(oa); transpose8(orr);
      for (int k = 0; k < 8; ++k) {
        _mm256_storeu_ps(adv + p[k] - i - 7, oa[k]);
        _mm256_storeu_ps(ret + p[k] - i - 7, orr[k]);
      }
      continue;
    }
    uint64_t mb[8];
    for (int k = 0; k < 8; ++k) {
      r[k] = _mm256_loadu_ps(rew + p[k] - i - 7);
      v[k] = _mm256_loadu_ps(val + p[k] - i - 7);
      std::memcpy(&mb[k], mask + p[k] - i - 7, 8);
    }
    if (V != 1 && V != 4) { transpose8(r); transpose8(v); }
    __mmask8 mm[8];
    {
      const __m512i mq = _mm512_loadu_si512(mb);
      for (int c = 0; c < 8; ++c) mm[c] = _mm512_test_epi64_mask(mq, _mm512_set1_epi64(1ll << (8 * c)));
    }
    for (int c = 7; c >= 0; --c) {
      const __mmask8 m = V == 11 ? (__mmask8)0xFF : mm[c];
      const __m512d rd = _mm512_cvtps_pd(r[c]), vd = _mm512_cvtps_pd(v[c]);
      const __m512d d = _mm512_sub_pd(_mm512_fmadd_pd(g, vn, rd), vd);
      a = _mm512_mask_fmadd_pd(a, m, gl, d);
      ac = a;
      vn = _mm512_mask_mov_pd(vn, m, vd);
      oa[c] = _mm512_cvtpd_ps(_mm512_maskz_mul_pd(m, sc, a));
      orr[c] = _mm512_cvtpd_ps(_mm512_maskz_add_pd(m, ac, vd));
    }
    if (V != 1 && V != 5) { transpose8(oa); transpose8(orr); }
    for (int k = 0; k < 8; ++k) {
      _mm256_storeu_ps(adv + p[k] - i - 7, oa[k]);
      _mm256_storeu_ps(ret + p[k] - i - 7, orr[k]);
    }
  }
  _mm512_storeu_pd(a_, a), _mm512_storeu_pd(ac_, ac), _mm512_storeu_pd(vn_, vn);
  return i;
}

// 16x16 transpose of rows x[0..15] in 4 rounds of 16 shuffles
A512 static inline void transpose16(__m512* x) {
  __m512 t[16], u[16];
  for (int k = 0; k < 16; k += 2) t[k] = _mm512_unpacklo_ps(x[k], x[k + 1]), t[k + 1] = _mm512_unpackhi_ps(x[k], x[k + 1]);
  for (int k = 0; k < 16; k += 4) {  // u[4g+m], 128-bit lane j: column 4j+m of rows 4g..4g+3
    u[k] = _mm512_shuffle_ps(t[k], t[k + 2], 0x44), u[k + 1] = _mm512_shuffle_ps(t[k], t[k + 2], 0xEE);
    u[k + 2] = _mm512_shuffle_ps(t[k + 1], t[k + 3], 0x44), u[k + 3] = _mm512_shuffle_ps(t[k + 1], t[k + 3], 0xEE);
  }
  for (int m = 0; m < 4; ++m) {
    const __m512 v0 = _mm512_shuffle_f32x4(u[m], u[4 + m], 0x88), v1 = _mm512_shuffle_f32x4(u[m], u[4 + m], 0xDD);
    const __m512 v2 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0x88), v3 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0xDD);
    x[m] = _mm512_shuffle_f32x4(v0, v2, 0x88), x[8 + m] = _mm512_shuffle_f32x4(v0, v2, 0xDD);
    x[4 + m] = _mm512_shuffle_f32x4(v1, v3, 0x88), x[12 + m] = _mm512_shuffle_f32x4(v1, v3, 0xDD);
  }
}
struct MIdx { uint8_t idx[4][64]; };
static MIdx make_midx() {  // position 16*cc + k of group g <- byte 16*(k%4) + 4g + cc of z_{k/4} (pairs z0|z1, z2|z3)
  MIdx m;
  for (int g = 0; g < 4; ++g)
    for (int cc = 0; cc < 4; ++cc)
      for (int k = 0; k < 16; ++k) m.idx[g][16 * cc + k] = (uint8_t)(((k % 8) >= 4 ? 64 : 0) + 16 * (k % 4) + 4 * g + cc);
  return m;
}
static const MIdx MIDX = make_midx();
struct F16 { float a[16], vn[16], gl[16], sc[16]; };
template <int V>
A512 __attribute__((noinline)) int64_t lockstep16(const S& s, F16& st, const int64_t* p, int64_t steps) {
  __m512 a = _mm512_loadu_ps(st.a), vn = _mm512_loadu_ps(st.vn);
  const __m512 gl = _mm512_loadu_ps(st.gl), sc = _mm512_loadu_ps(st.sc), g = _mm512_set1_ps((float)s.gamma);
  int64_t i = 0;
  for (; i + 16 <= steps; i += 16) {
    __m512 r[16], v[16], oa[16], orr[16];
    for (int k = 0; k < 16; ++k) {
      r[k] = _mm512_loadu_ps(s.rew + p[k] - i - 15);
      v[k] = _mm512_loadu_ps(s.val + p[k] - i - 15);
    }
    if (V == 6) { transpose16(r); transpose16(v); }
    __mmask64 mg[4];
    if (V != 8) {  // mask bytes: z_j = chains 4j..4j+3 (16 bytes each); regrouped so vector g holds columns
      __m512i z[4];  // 4g..4g+3 of all 16 chains (byte 16*(c%4) + chain)
      for (int j = 0; j < 4; ++j) {
        __m512i t = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)(s.mask + p[4 * j] - i - 15)));
        for (int q = 1; q < 4; ++q)
          t = _mm512_inserti32x4(t, _mm_loadu_si128((const __m128i*)(s.mask + p[4 * j + q] - i - 15)), q);
        z[j] = t;
      }
      for (int g2 = 0; g2 < 4; ++g2) {
        const __m512i idx = _mm512_loadu_si512(MIDX.idx[g2]);
        const __m512i a = _mm512_permutex2var_epi8(z[0], idx, z[1]), b = _mm512_permutex2var_epi8(z[2], idx, z[3]);
        const __m512i o = _mm512_mask_blend_epi8(0xFF00FF00FF00FF00ull, a, b);
        mg[g2] = _mm512_test_epi8_mask(o, o);
      }
    }
    for (int c = 15; c >= 0; --c) {
      const __mmask16 m = V == 8 ? (__mmask16)0xFFFF : (__mmask16)(mg[c / 4] >> (16 * (c % 4)));
      const __m512 d = _mm512_sub_ps(_mm512_fmadd_ps(g, vn, r[c]), v[c]);
      a = _mm512_mask_fmadd_ps(a, m, gl, d);  // a = a * gl + d at trainable tokens
      vn = _mm512_mask_mov_ps(vn, m, v[c]);
      oa[c] = _mm512_maskz_mul_ps(m, sc, a);
      orr[c] = _mm512_maskz_add_ps(m, a, v[c]);
    }
    if (V == 6) { transpose16(oa); transpose16(orr); }
    for (int k = 0; k < 16; ++k) {
      _mm512_storeu_ps(s.adv + p[k] - i - 15, oa[k]);
      _mm512_storeu_ps(s.ret + p[k] - i - 15, orr[k]);
    }
  }
  _mm512_storeu_ps(st.a, a), _mm512_storeu_ps(st.vn, vn);
  return i;
}
// the same operations one token at a time (what V6 must reproduce bit for bit)
static void scalar16(const S& s, F16& st, const int64_t* p, int64_t steps) {
  for (int k = 0; k < 16; ++k)
    for (int64_t i = 0; i < steps; ++i) {
      const int64_t t = p[k] - i;
      const bool m = s.mask[t];
      const float d = std::fmaf((float)s.gamma, st.vn[k], s.rew[t]) - s.val[t];
      if (m) st.a[k] = std::fmaf(st.gl[k], st.a[k], d), st.vn[k] = s.val[t];
      s.adv[t] = m ? st.sc[k] * st.a[k] : 0.f;
      s.ret[t] = m ? st.a[k] + s.val[t] : 0.f;
    }
}
int main(int argc, char** argv) {
  int64_t L = argc > 1 ? atoll(argv[1]) : 8192, R = 16;
  int64_t reps = argc > 2 ? atoll(argv[2]) : 200;
  std::vector<float> rew(R * L), val(R * L), adv(R * L), ret(R * L);
  std::vector<char> maskc(R * L);
  srand(1);
  for (auto& x : rew) x = rand() / (float)RAND_MAX;
  for (auto& x : val) x = rand() / (float)RAND_MAX;
  for (auto& x : maskc) x = (rand() % 10) < 7;
  S s{rew.data(), val.data(), (const bool*)maskc.data(), adv.data(), ret.data(), 1.0};
  double gl[8], glc[8], sc[8];
  for (int k = 0; k < 8; ++k) gl[k] = glc[k] = 0.95, sc[k] = 1.0;
  std::vector<float> ref_adv, f32_adv, f32_ret;
  {  // the scalar float32 loop, for V6's check
    F16 st{};
    int64_t p[16];
    for (int k = 0; k < 16; ++k) p[k] = k * L + L - 1, st.gl[k] = 0.95f, st.sc[k] = 1.f;
    std::fill(adv.begin(), adv.end(), -1.f), std::fill(ret.begin(), ret.end(), -1.f);
    scalar16(s, st, p, L / 16 * 16);
    f32_adv = adv, f32_ret = ret;
  }
  for (int V : {0, 1, 3, 4, 5, 6, 7, 8, 11, 0, 1, 3, 4, 5, 6, 7, 8, 11}) {
    std::vector<double> ts;
    std::fill(adv.begin(), adv.end(), -1.f), std::fill(ret.begin(), ret.end(), -1.f);
    for (int rep = 0; rep < reps; ++rep) {
      int64_t p[16];
      for (int k = 0; k < 16; ++k) p[k] = k * L + L - 1;
      auto t0 = std::chrono::steady_clock::now();
      if (V >= 6 && V <= 8) {
        F16 st{};
        for (int k = 0; k < 16; ++k) st.gl[k] = 0.95f, st.sc[k] = 1.f;
        if (V == 6) lockstep16<6>(s, st, p, L / 16 * 16);
        if (V == 7) lockstep16<7>(s, st, p, L / 16 * 16);
        if (V == 8) lockstep16<8>(s, st, p, L / 16 * 16);
      } else {
        for (int h = 0; h < 2; ++h) {
          double a[8] = {}, ac[8] = {}, vn[8] = {};
          if (V == 0) lockstep<0>(s, a, ac, vn, gl, glc, sc, p + 8 * h, L);
          if (V == 1) lockstep<1>(s, a, ac, vn, gl, glc, sc, p + 8 * h, L);
          if (V == 3) lockstep<3>(s, a, ac, vn, gl, glc, sc, p + 8 * h, L);
          if (V == 4) lockstep<4>(s, a, ac, vn, gl, glc, sc, p + 8 * h, L);
          if (V == 5) lockstep<5>(s, a, ac, vn, gl, glc, sc, p + 8 * h, L);
          if (V == 11) lockstep<11>(s, a, ac, vn, gl, glc, sc, p + 8 * h, L);
        }
      }
      auto t1 = std::chrono::steady_clock::now();
      ts.push_back(std::chrono::duration<double>(t1 - t0).count());
    }
    std::sort(ts.begin(), ts.end());
    if (V == 0 && ref_adv.empty()) ref_adv = adv;
    bool same = V == 1 || V == 7 || V == 8 || V == 11 ? true
              : V == 6 ? f32_adv == adv && f32_ret == ret
              : std::equal(adv.begin(), adv.end(), ref_adv.begin());
    printf("V%d L=%ld: %.3f ns/token  same=%d\n", V, L, ts[ts.size() / 2] / (R * L) * 1e9, same);
  }
}
