// The vector width and register budget of the instruction set this file is built
// for (cpu_gemm.py builds every source once with -mavx512f and once with -mavx2):
// the kernels are written once against these few wrappers.
#pragma once
#include <immintrin.h>
#include <stdint.h>

namespace adaserve {

#if defined(__AVX512F__)
// 32 zmm registers: 8 rows x 2 vectors x up to 2 blocks of accumulators.
using vec = __m512;
using vmask = __mmask16;
constexpr int kLanes = 16;
constexpr int kRows = 8;
constexpr int kMaxBlocksPerTile = 2;
// Quantized weights for more rows than this are dequantized once per block into a
// scratch (skinny_gemm.cpp): 64 rows take 0.87x the time; 9-16 rows gain nothing.
constexpr int kScratchRows = 2 * kRows;
// Rows per tile of the int8-activation path: 8 x 2 int32 accumulators.
constexpr int kI8Rows = 8;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vset1(float x) { return _mm512_set1_ps(x); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec vload(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
// 16 int8 values -> 16 / kLanes float vectors (exact); kLanes float16 -> float.
inline void vcvt_i8x16(__m128i b, vec* out) { out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }
inline vec vload_f16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}
// 16 bytes of two nibbles each -> 32 floats: out[0] the low nibbles, out[1] the high
// ones (widened to int32 first, so the high nibble is one shift, no mask).
inline void vcvt_nibbles(const uint8_t* p, vec* out) {
  const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  out[0] = _mm512_cvtepi32_ps(_mm512_and_si512(d, _mm512_set1_epi32(15)));
  out[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(d, 4));
}
inline vmask vmask_first(int64_t n) {
  return n >= 16 ? (vmask)0xFFFF : n <= 0 ? (vmask)0 : (vmask)((1u << n) - 1);
}
inline bool vmask_any(vmask m) { return m != 0; }
inline vec vload_masked(vmask m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
inline void vstore_masked(float* p, vmask m, vec v) { _mm512_mask_storeu_ps(p, m, v); }
// Integer dot products (the int8-activation path, skinny_gemm.cpp's QuantI8; needs
// AVX-512BW, which every CPU torch calls AVX512 has): ivec holds kLanes int32 lanes.
using ivec = __m512i;
inline ivec izero() { return _mm512_setzero_si512(); }
inline ivec iload(const void* p) { return _mm512_loadu_si512(p); }
inline ivec iset1(int32_t v) { return _mm512_set1_epi32(v); }
inline ivec inib_lo(ivec v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
inline ivec inib_hi(ivec v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
// acc + per int32 lane the sum of its 4 products u8(a) * s8(b), exact (no pair of
// products here exceeds int16: |a| <= 128, |b| <= 127).
#if defined(__AVX512VNNI__)
// The avx512vnni build: vpdpbusd adds each lane's 4 products to it in one instruction,
// exactly, so the same sums, bit for bit, as the three-instruction form below (which
// never saturates here) at a third of the instructions: the int8 path's multi-row
// verification is bound by these.
inline ivec idot(ivec acc, ivec a, ivec b) { return _mm512_dpbusd_epi32(acc, a, b); }
#else
inline ivec idot(ivec acc, ivec a, ivec b) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(a, b), _mm512_set1_epi16(1)));
}
#endif
// Signed weights: |w| as u8, and b with w's sign.
inline ivec iabs8(ivec w) { return _mm512_abs_epi8(w); }
inline ivec isign8(ivec b, ivec w) {  // where w is 0 the product is 0 anyway
  return _mm512_mask_sub_epi8(b, _mm512_movepi8_mask(w), _mm512_setzero_si512(), b);
}
inline vec icvt(ivec v) { return _mm512_cvtepi32_ps(v); }
// Lane-wise pieces of vexp (below): floor, 2^n for integral n in [-126, 127], and x
// with the lanes where x < lo (-inf included) set to 0.
inline vec vfloor(vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline vec vmin(vec a, vec b) { return _mm512_min_ps(a, b); }
inline vec vselect(vmask m, vec a, vec b) { return _mm512_mask_blend_ps(m, b, a); }  // m ? a : b
inline vec vpow2(vec n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline vec vzero_below(vec y, vec x, float lo) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(lo), _CMP_GE_OQ), y);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// 16 ymm registers: a tile of 5 rows x 4 vectors (one block) spills some accumulators
// to L1, yet on Zen 3 a forward's linear layers for 5 rows cost ~1.1x one row with it,
// against ~1.4x with 2 rows (no spill, but a third pass over each block).
using vec = __m256;
using vmask = __m256i;
constexpr int kLanes = 8;
constexpr int kRows = 5;
constexpr int kMaxBlocksPerTile = 1;
// As for AVX-512: with the scratch from 6 rows on, 6-16 rows took 1.1-1.3x longer.
constexpr int kScratchRows = 2 * kRows;
// Rows per tile of the int8-activation path: 2 x 4 int32 accumulators, 4 weights.
constexpr int kI8Rows = 2;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vset1(float x) { return _mm256_set1_ps(x); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec vload(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
inline void vcvt_i8x16(__m128i b, vec* out) {
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
}
inline vec vload_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }  // F16C
// 16 bytes of two nibbles each -> 32 floats: out[0..1] the low nibbles (bytes 0-7,
// 8-15), out[2..3] the high ones.
inline void vcvt_nibbles(const uint8_t* p, vec* out) {
  const __m256i d0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  const __m256i d1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8)));
  const __m256i m = _mm256_set1_epi32(15);
  out[0] = _mm256_cvtepi32_ps(_mm256_and_si256(d0, m));
  out[1] = _mm256_cvtepi32_ps(_mm256_and_si256(d1, m));
  out[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(d0, 4));
  out[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(d1, 4));
}
inline vmask vmask_first(int64_t n) {
  const int c = n >= 8 ? 8 : n <= 0 ? 0 : (int)n;
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline bool vmask_any(vmask m) { return !_mm256_testz_si256(m, m); }
inline vec vload_masked(vmask m, const float* p) { return _mm256_maskload_ps(p, m); }
inline void vstore_masked(float* p, vmask m, vec v) { _mm256_maskstore_ps(p, m, v); }
using ivec = __m256i;
inline ivec izero() { return _mm256_setzero_si256(); }
inline ivec iload(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline ivec iset1(int32_t v) { return _mm256_set1_epi32(v); }
inline ivec inib_lo(ivec v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
inline ivec inib_hi(ivec v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
inline ivec idot(ivec acc, ivec a, ivec b) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
}
inline ivec iabs8(ivec w) { return _mm256_sign_epi8(w, w); }
inline ivec isign8(ivec b, ivec w) { return _mm256_sign_epi8(b, w); }
inline vec icvt(ivec v) { return _mm256_cvtepi32_ps(v); }
inline vec vfloor(vec x) { return _mm256_floor_ps(x); }
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
inline vec vmin(vec a, vec b) { return _mm256_min_ps(a, b); }
inline vec vselect(vmask m, vec a, vec b) { return _mm256_blendv_ps(b, a, _mm256_castsi256_ps(m)); }
inline vec vpow2(vec n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline vec vzero_below(vec y, vec x, float lo) {
  return _mm256_and_ps(y, _mm256_cmp_ps(x, _mm256_set1_ps(lo), _CMP_GE_OQ));
}
#else
#error "skinny_gemm.cpp needs -mavx512f or -mavx2 -mfma -mf16c"
#endif

// Horizontal sum, always in the same order (a fixed tree over the lanes).
inline float vsum(vec v) {
#if defined(__AVX512F__)
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
#else
  const __m256 h = v;
#endif
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// The kLanes horizontal sums of kLanes vectors v[0..kLanes) at once, by a transposing
// tree of adds: w[i] = vsum_pair(v[2i], v[2i + 1]) for each pair, then
// vsum_lanes_rest(w), whose lane kSumOrder[s] is the sum of v[s]'s lanes (each in one
// fixed order of its own, not vsum's). So v[s] = item kSumOrder[s]'s vector puts item
// i's sum in lane i; taken pair by pair, 8 vectors are live instead of 16.
#if defined(__AVX512F__)
constexpr int kSumOrder[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
inline vec vsum_pair(vec a, vec b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}
inline vec vsum_lanes_rest(const vec (&w)[8]) {
  vec x[4], y[2];
  for (int i = 0; i < 4; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
}
#else
constexpr int kSumOrder[8] = {0, 4, 1, 5, 2, 6, 3, 7};
inline vec vsum_pair(vec a, vec b) {
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
inline vec vsum_lanes_rest(const vec (&w)[4]) {
  vec x[2];
  for (int i = 0; i < 2; ++i)
    x[i] = _mm256_add_ps(_mm256_shuffle_ps(w[2 * i], w[2 * i + 1], 0x44),
                         _mm256_shuffle_ps(w[2 * i], w[2 * i + 1], 0xEE));
  return _mm256_add_ps(_mm256_shuffle_ps(x[0], x[1], 0x88), _mm256_shuffle_ps(x[0], x[1], 0xDD));
}
#endif

// exp(x) per lane (Cephes' expf: x = n ln2 + r, a degree-7 polynomial in r, times
// 2^n), within ~2 ulp of expf; exactly 0 below -87.3 (and for -inf). Each lane is the
// same sequence of correctly rounded operations on both builds, so an element's
// result depends on its value alone, never on its lane or its neighbours.
inline vec vexp(vec x) {
  constexpr float lo = -87.3365447f, hi = 88.3762626647949f;
  const vec xc = vmin(vmax(x, vset1(lo)), vset1(hi));
  const vec n = vfloor(vfma(xc, vset1(1.44269504088896341f), vset1(0.5f)));
  vec r = vfma(n, vset1(-0.693359375f), xc);
  r = vfma(n, vset1(2.12194440e-4f), r);
  vec p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), r);
  p = vadd(p, vset1(1.0f));
  return vzero_below(vmul(p, vpow2(n)), x, lo);
}

// The 16 floats from p as kWide vectors (one on AVX-512, two on AVX2), and their sum
// in one fixed order on both builds: lane i + lane i + 8, then vsum's tree.
constexpr int kWide = 16 / kLanes;
inline float vsum_wide(const vec (&acc)[kWide]) {
#if defined(__AVX512F__)
  return vsum(acc[0]);
#else
  return vsum(vadd(acc[0], acc[1]));
#endif
}

}  // namespace adaserve
