// y[M, N] = x[M, K] @ W^T (+ bias) for fp32 on x86-64 CPUs with AVX-512 or AVX2 + FMA,
// with W packed as [ceil(N / 32), K, 32]: each block of 32 output columns is one
// contiguous stream. The same source builds once per instruction set (cpu_gemm.py
// passes -mavx512f or -mavx2); only the vector width and the register tile differ
// (simd.h).
//
// Decoding and tree verification multiply a few rows (M = 1..16) by large weights, so
// their cost is reading the weights. A tile holds a few rows of outputs in registers
// and streams its blocks' weights once for all of them (later row groups re-read the
// block from L2, not DRAM), so 5 rows cost about what 1 does; MKL's sgemm pays ~1.5x
// for 5 rows on an Intel AVX-512 host and 2-3x on an AMD AVX2 one (cpu_gemm.py).
// Every output is the same sequential FMA chain over k whatever M and the tiling are,
// so a token's logits do not depend on how many tree tokens were verified beside it,
// and both builds give the same bits.
//
// The same kernel takes int8 weights with one float scale per output (a CPU drafter's
// layers): a quarter of the bytes to stream, converted to float in registers, while
// the activations stay float32 (fbgemm's dynamic int8 quantizes them too).
//
// Plain C ABI, no torch headers: it builds in about a second and is called through
// ctypes. Threads come from OpenMP; loaded into a process that imported torch, the
// soname libgomp.so.1 resolves to torch's own runtime and thread pool.
#include <omp.h>

#include "simd.h"

namespace {

using namespace adaserve;


constexpr int64_t kBlock = 32;   // output columns per packed block
constexpr int kVecs = kBlock / kLanes;  // vectors per block row
constexpr int64_t kAhead = 32;   // prefetch distance in k: 4 KB ahead in each stream
constexpr int64_t kChunk = 128;  // features per FMA chain (see tile)

// M rows x B adjacent blocks (B * 32 columns) over features [k0, k1); ncols: valid
// columns from the first. The first chunk stores its sums, later ones add theirs to y,
// and the last applies the scale (int8 weights) and adds the bias: per output,
// sequential FMA chains of kChunk features summed in order, about as accurate as MKL's
// own k-blocking (one chain over all 1536 features of a down projection drifts ~2x
// further from float64).
template <typename W, int M, int B>
inline void tile(const float* x, int64_t K, int64_t k0, int64_t k1, const W* w,
                 const float* scale, const float* bias, float* y, int64_t ldy, int64_t ncols) {
  constexpr int V = kVecs * B;
  vec acc[M][V];
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) acc[m][v] = vzero();
  const int64_t bs = K * kBlock;
  for (int64_t k = k0; k < k1; ++k) {
    vec wv[V];
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) {
      const W* p = w + b * bs + k * kBlock;
      _mm_prefetch((const char*)(p + kAhead * kBlock), _MM_HINT_T0);
      if (sizeof(W) * kBlock > 64) _mm_prefetch((const char*)(p + kAhead * kBlock + 16), _MM_HINT_T0);
#pragma GCC unroll 4
      for (int j = 0; j < kVecs; ++j) wv[kVecs * b + j] = vload(p + kLanes * j);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const vec xv = vset1(x[m * K + k]);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) acc[m][v] = vfma(xv, wv[v], acc[m][v]);
    }
  }
  const bool first = k0 == 0, last = k1 == K;
#pragma GCC unroll 8
  for (int v = 0; v < V; ++v) {
    const vmask mk = vmask_first(ncols - kLanes * v);
    if (!vmask_any(mk)) break;
    const vec bv = last && bias != nullptr ? vload_masked(mk, bias + kLanes * v) : vzero();
    const vec sv = last && scale != nullptr ? vload_masked(mk, scale + kLanes * v) : vzero();
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      float* out = y + m * ldy + kLanes * v;
      vec sum = first ? acc[m][v] : vadd(vload_masked(mk, out), acc[m][v]);
      if (last && scale != nullptr) sum = vmul(sum, sv);
      if (last && bias != nullptr) sum = vadd(sum, bv);
      vstore_masked(out, mk, sum);
    }
  }
}

template <typename W, int B, int R>
inline void tile_rows(const float* x, int64_t m, int64_t K, int64_t k0, int64_t k1, const W* w,
                      const float* scale, const float* bias, float* y, int64_t N, int64_t ncols) {
  if constexpr (R > 1) {
    if (m < R) return tile_rows<W, B, R - 1>(x, m, K, k0, k1, w, scale, bias, y, N, ncols);
  }
  tile<W, R, B>(x, K, k0, k1, w, scale, bias, y, N, ncols);
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
      tile_rows<W, B, kRows>(xm, m, K, k0, k1, w, scale, bias, ym, N, ncols);
    }
  }
}

template <typename W>
void linear(const float* x, int64_t M, int64_t K, const W* packed, const float* scale,
            int64_t N, const float* bias, float* y, int threads) {
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  // Few rows: two blocks per tile where registers allow, for more independent FMA
  // chains and weight streams.
  const int64_t per = M <= 4 && kMaxBlocksPerTile >= 2 ? 2 : 1;
  const int64_t tiles = (blocks + per - 1) / per;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t b = t * per;
    const W* w = packed + b * K * kBlock;
    const float* sb = scale == nullptr ? nullptr : scale + b * kBlock;
    const float* bb = bias == nullptr ? nullptr : bias + b * kBlock;
    const int64_t ncols = N - b * kBlock;
    float* yb = y + b * kBlock;
    if constexpr (kMaxBlocksPerTile >= 2) {
      if (per == 2 && b + 1 < blocks) {
        rows<W, 2>(x, M, K, w, sb, bb, yb, N, ncols);
        continue;
      }
    }
    rows<W, 1>(x, M, K, w, sb, bb, yb, N, ncols);
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
