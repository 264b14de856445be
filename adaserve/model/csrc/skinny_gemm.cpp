// y[M, N] = x[M, K] @ W^T (+ bias) for fp32 on AVX-512 CPUs, with W packed as
// [ceil(N / 32), K, 32]: each block of 32 output columns is one contiguous stream.
//
// Decoding and tree verification multiply a few rows (M = 1..16) by large weights, so
// their cost is reading the weights. A tile holds up to 8 rows of outputs in registers
// and streams its blocks' weights once for all of them, so 5 rows cost about what 1
// does; MKL's sgemm pays ~1.5x for 5 rows on the same host (adaserve/model/cpu_gemm.py).
// Every output is the same sequential FMA chain over k whatever M and the tiling are,
// so a token's logits do not depend on how many tree tokens were verified beside it.
//
// The same kernel takes int8 weights with one float scale per output (a CPU drafter's
// layers): a quarter of the bytes to stream, converted to float in registers, while
// the activations stay float32 (fbgemm's dynamic int8 quantizes them too).
//
// Plain C ABI, no torch headers: it builds in about a second and is called through
// ctypes. Threads come from OpenMP; loaded into a process that imported torch, the
// soname libgomp.so.1 resolves to torch's own runtime and thread pool.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

namespace {

constexpr int64_t kBlock = 32;   // output columns per packed block: two zmm registers
constexpr int kRows = 8;         // rows per register tile (8 x 2 x 2 zmm accumulators at most)
constexpr int64_t kAhead = 32;   // prefetch distance in k: 4 KB ahead in each stream
constexpr int64_t kChunk = 128;  // features per FMA chain (see tile)

// 16 weights of a block row as floats.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}

inline __mmask16 mask(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1); }

// M rows x B adjacent blocks (B * 32 columns) over features [k0, k1); ncols: valid
// columns from the first. The first chunk stores its sums, later ones add theirs to y,
// and the last applies the scale (int8 weights) and adds the bias: per output, sequential FMA chains of kChunk features
// summed in order, about as accurate as MKL's own k-blocking (one chain over all 1536
// features of a down projection drifts ~2x further from float64).
template <typename W, int M, int B>
inline void tile(const float* x, int64_t K, int64_t k0, int64_t k1, const W* w,
                 const float* scale, const float* bias, float* y, int64_t ldy, int64_t ncols) {
  constexpr int V = 2 * B;
  __m512 acc[M][V];
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[m][v] = _mm512_setzero_ps();
  const int64_t bs = K * kBlock;
  for (int64_t k = k0; k < k1; ++k) {
    __m512 wv[V];
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) {
      const W* p = w + b * bs + k * kBlock;
      _mm_prefetch((const char*)(p + kAhead * kBlock), _MM_HINT_T0);
      if (sizeof(W) * kBlock > 64) _mm_prefetch((const char*)(p + kAhead * kBlock + 16), _MM_HINT_T0);
      wv[2 * b] = load16(p);
      wv[2 * b + 1] = load16(p + 16);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * K + k]);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[m][v] = _mm512_fmadd_ps(xv, wv[v], acc[m][v]);
    }
  }
  const bool first = k0 == 0, last = k1 == K;
#pragma GCC unroll 4
  for (int v = 0; v < V; ++v) {
    const __mmask16 mk = mask(ncols - 16 * v);
    if (mk == 0) break;
    const __m512 bv = last && bias != nullptr ? _mm512_maskz_loadu_ps(mk, bias + 16 * v)
                                              : _mm512_setzero_ps();
    const __m512 sv = last && scale != nullptr ? _mm512_maskz_loadu_ps(mk, scale + 16 * v)
                                               : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      float* out = y + m * ldy + 16 * v;
      __m512 sum = first ? acc[m][v] : _mm512_add_ps(_mm512_maskz_loadu_ps(mk, out), acc[m][v]);
      if (last && scale != nullptr) sum = _mm512_mul_ps(sum, sv);
      if (last && bias != nullptr) sum = _mm512_add_ps(sum, bv);
      _mm512_mask_storeu_ps(out, mk, sum);
    }
  }
}

template <typename W, int B>
inline void rows(const float* x, int64_t M, int64_t K, const W* w, const float* scale,
                 const float* bias, float* y, int64_t N, int64_t ncols) {
  for (int64_t m0 = 0; m0 < M; m0 += kRows) {
    const float* xm = x + m0 * K;
    float* ym = y + m0 * N;
    const int64_t m = M - m0 < kRows ? M - m0 : kRows;
    for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
      const int64_t k1 = K - k0 < kChunk ? K : k0 + kChunk;
      switch (m) {
        case 1: tile<W, 1, B>(xm, K, k0, k1, w, scale, bias, ym, N, ncols); break;
        case 2: tile<W, 2, B>(xm, K, k0, k1, w, scale, bias, ym, N, ncols); break;
        case 3: tile<W, 3, B>(xm, K, k0, k1, w, scale, bias, ym, N, ncols); break;
        case 4: tile<W, 4, B>(xm, K, k0, k1, w, scale, bias, ym, N, ncols); break;
        case 5: tile<W, 5, B>(xm, K, k0, k1, w, scale, bias, ym, N, ncols); break;
        case 6: tile<W, 6, B>(xm, K, k0, k1, w, scale, bias, ym, N, ncols); break;
        case 7: tile<W, 7, B>(xm, K, k0, k1, w, scale, bias, ym, N, ncols); break;
        default: tile<W, 8, B>(xm, K, k0, k1, w, scale, bias, ym, N, ncols); break;
      }
    }
  }
}

template <typename W>
void linear(const float* x, int64_t M, int64_t K, const W* packed, const float* scale,
            int64_t N, const float* bias, float* y, int threads) {
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  // Few rows: two blocks per tile, for more independent FMA chains and weight streams.
  const int64_t per = M <= 4 ? 2 : 1;
  const int64_t tiles = (blocks + per - 1) / per;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t b = t * per;
    const W* w = packed + b * K * kBlock;
    const float* sb = scale == nullptr ? nullptr : scale + b * kBlock;
    const float* bb = bias == nullptr ? nullptr : bias + b * kBlock;
    const int64_t ncols = N - b * kBlock;
    float* yb = y + b * kBlock;
    if (per == 2 && b + 1 < blocks) rows<W, 2>(x, M, K, w, sb, bb, yb, N, ncols);
    else rows<W, 1>(x, M, K, w, sb, bb, yb, N, ncols);
  }
}

}  // namespace

extern "C" int adaserve_skinny_block() { return (int)kBlock; }

// packed: float32, or int8 when scale (one float per output column, zero-padded like
// packed to whole blocks) is given.
extern "C" void adaserve_skinny_linear(const float* x, int64_t M, int64_t K, const void* packed,
                                       const float* scale, int64_t N, const float* bias, float* y,
                                       int threads) {
  if (scale == nullptr) linear<float>(x, M, K, (const float*)packed, nullptr, N, bias, y, threads);
  else linear<int8_t>(x, M, K, (const int8_t*)packed, scale, N, bias, y, threads);
}
