// Experiment behind benchmarks/results/gae-cpu-transposes.md (not built, not part of the package): the AVX-512
// lockstep scan of csrc/cpu/gae.cpp (no own critic) on 8 chains of L tokens, with variants that leave out parts of
// the data movement. V0: as shipped (8x8 float transposes of rewards and values in, advantages and returns out);
// V1: no transposes at all (wrong results, timing only); V3: the inputs through 512-bit two-source permutes
// (vpermt2ps) instead, same results; V4: no input transposes; V5: no output transposes (both timing only).
//   g++ -O3 -o gae-cpu-transposes gae-cpu-transposes.cpp && ./gae-cpu-transposes 8229 300
// L = 8229, not 8192: chains 2^k floats apart put all 40 streams in the same L1 sets (0.92 ns/token for V0).
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <chrono>
#include <algorithm>
#define A512 __attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma,gfni")))
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
      const __mmask8 m = mm[c];
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
int main(int argc, char** argv) {
  int64_t L = argc > 1 ? atoll(argv[1]) : 8192, R = 8;
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
  std::vector<float> ref_adv;
  for (int V : {0, 1, 3, 4, 5, 0, 1, 3, 4, 5}) {
    std::vector<double> ts;
    for (int rep = 0; rep < reps; ++rep) {
      double a[8] = {}, ac[8] = {}, vn[8] = {};
      int64_t p[8];
      for (int k = 0; k < 8; ++k) p[k] = k * L + L - 1;
      auto t0 = std::chrono::steady_clock::now();
      if (V == 0) lockstep<0>(s, a, ac, vn, gl, glc, sc, p, L);
      if (V == 1) lockstep<1>(s, a, ac, vn, gl, glc, sc, p, L);
      if (V == 3) lockstep<3>(s, a, ac, vn, gl, glc, sc, p, L);
      if (V == 4) lockstep<4>(s, a, ac, vn, gl, glc, sc, p, L);
      if (V == 5) lockstep<5>(s, a, ac, vn, gl, glc, sc, p, L);
      auto t1 = std::chrono::steady_clock::now();
      ts.push_back(std::chrono::duration<double>(t1 - t0).count());
    }
    std::sort(ts.begin(), ts.end());
    if (V == 0 && ref_adv.empty()) ref_adv = adv;
    bool same = V == 1 ? true : std::equal(adv.begin(), adv.end(), ref_adv.begin());
    printf("V%d L=%ld: %.3f ns/token  same=%d\n", V, L, ts[ts.size() / 2] / (R * L) * 1e9, same);
  }
}
