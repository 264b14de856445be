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
// And it takes GGUF's Q4_0 / Q4_1 / Q8_0 blocks as stored (Quant below), dequantized
// exactly in registers once per feature and tile of rows, then the same FMA chains:
// the bits of the float32 kernel over the GGUF's dequantized weights.
//
// Plain C ABI, no torch headers: it builds in about a second and is called through
// ctypes. Threads come from OpenMP; loaded into a process that imported torch, the
// soname libgomp.so.1 resolves to torch's own runtime and thread pool.
#include <omp.h>

#include <vector>

#include "simd.h"

namespace {

using namespace adaserve;


constexpr int64_t kBlock = 32;   // output columns per packed block
constexpr int kVecs = kBlock / kLanes;  // vectors per block row
constexpr int64_t kAhead = 32;   // prefetch distance in k: 4 KB ahead in each stream
constexpr int64_t kChunk = 128;  // features per FMA chain (see tile)

template <int M, int V>
inline void zero(vec (&acc)[M][V]) {
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) acc[m][v] = vzero();
}

// One feature's step of every output's FMA chain: acc[m] += x[m * K] * w, per row m.
template <int M, int V>
inline void fma_rows(vec (&acc)[M][V], const float* x, int64_t K, const vec* wv) {
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
    const vec xv = vset1(x[m * K]);
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) acc[m][v] = vfma(xv, wv[v], acc[m][v]);
  }
}

// Stores a tile's sums: the first chunk of features stores them, later ones add
// theirs to y, and the last applies the scale (int8 weights) and adds the bias.
template <int M, int V>
inline void store(vec (&acc)[M][V], bool first, bool last, const float* scale,
                  const float* bias, float* y, int64_t ldy, int64_t ncols) {
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

// Weights as float32 or int8 (one float scale per output), packed [blocks, K, 32].
template <typename W>
struct Dense {
  static constexpr bool kQuant = false;
  const W* w;
  const float* scale;  // int8 only
  const float* bias;
  int64_t K;

  // M rows x B adjacent blocks (B * 32 columns, from block `blk`) over features
  // [k0, k1); ncols: valid columns from the first. Per output, sequential FMA chains
  // of kChunk features summed in order, about as accurate as MKL's own k-blocking
  // (one chain over all 1536 features of a down projection drifts ~2x further from
  // float64).
  template <int M, int B>
  void tile(const float* x, int64_t k0, int64_t k1, int64_t blk, float* y, int64_t ldy,
            int64_t ncols) const {
    constexpr int V = kVecs * B;
    vec acc[M][V];
    zero<M, V>(acc);
    const int64_t bs = K * kBlock;
    const W* wb = w + blk * bs;
    for (int64_t k = k0; k < k1; ++k) {
      vec wv[V];
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b) {
        const W* p = wb + b * bs + k * kBlock;
        _mm_prefetch((const char*)(p + kAhead * kBlock), _MM_HINT_T0);
        if (sizeof(W) * kBlock > 64) _mm_prefetch((const char*)(p + kAhead * kBlock + 16), _MM_HINT_T0);
#pragma GCC unroll 4
        for (int j = 0; j < kVecs; ++j) wv[kVecs * b + j] = vload(p + kLanes * j);
      }
      fma_rows<M, V>(acc, x + k, K, wv);
    }
    store<M, V>(acc, k0 == 0, k1 == K, scale == nullptr ? nullptr : scale + blk * kBlock,
                bias == nullptr ? nullptr : bias + blk * kBlock, y, ldy, ncols);
  }
};

// GGUF's quantized blocks (ggml-common.h), repacked by cpu_gemm.py per block of 32
// output columns and 32 features ("group"): the 32 columns' float16 scales d, then
// (Q4_1) their float16 minimums m, then for each of the 32 features the 32 columns'
// quants: Q8_0 one int8 each, Q4_* one nibble each (byte j holds column j low, column
// j + 16 high). A weight is q * d (Q8_0), (q - 8) * d (Q4_0) or q * d + m (Q4_1):
// ggml's own dequantization, and exact here too (a float16 times a small integer fits
// float32's mantissa; Q4_1's FMA rounds once, as ggml's multiply-then-add does), so the
// FMA chains below see the very floats of the GGUF's dequantized weights.
constexpr int64_t kGroup = 32;
enum Format : int { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };  // ggml_type ids

template <int F>
struct Quant {
  static constexpr bool kQuant = true;
  static constexpr bool kMin = F == kQ4_1;
  static constexpr int64_t kQuantBytes = F == kQ8_0 ? kGroup * kBlock : kGroup * kBlock / 2;
  static constexpr int64_t kBytes = 2 * kBlock * (kMin ? 2 : 1) + kQuantBytes;  // per group
  const uint8_t* w;  // [blocks, K / 32, kBytes]
  const float* bias;
  int64_t K;

  // The 32 dequantized weights of feature kk of a group, as kVecs vectors.
  static inline void weights(const uint8_t* q, int64_t kk, const vec* d, const vec* mn, vec* out) {
    vec qv[kVecs];
    if constexpr (F == kQ8_0) {
      const int8_t* p = (const int8_t*)q + kk * kBlock;
      vcvt_i8x16(_mm_loadu_si128((const __m128i*)p), qv);
      vcvt_i8x16(_mm_loadu_si128((const __m128i*)(p + 16)), qv + kVecs / 2);
    } else {
      vcvt_nibbles(q + kk * kBlock / 2, qv);
    }
#pragma GCC unroll 4
    for (int j = 0; j < kVecs; ++j) out[j] = F == kQ8_0 ? vmul(qv[j], d[j]) : vfma(qv[j], d[j], mn[j]);
  }

  // Column block `blk` dequantized into out [K, 32] (Dense<float>'s layout), the same
  // floats tile() makes in registers.
  void dequantize(int64_t blk, float* out) const {
    const uint8_t* p = w + blk * (K / kGroup * kBytes);
    for (int64_t g = 0; g < K / kGroup; ++g, p += kBytes) {
      vec d[kVecs], mn[kVecs];
      const uint16_t* h = (const uint16_t*)p;
      for (int j = 0; j < kVecs; ++j) {
        d[j] = vload_f16(h + kLanes * j);
        if constexpr (kMin) mn[j] = vload_f16(h + kBlock + kLanes * j);
        if constexpr (F == kQ4_0) mn[j] = vmul(d[j], vset1(-8.0f));
      }
      const uint8_t* q = p + 2 * kBlock * (kMin ? 2 : 1);
      for (int64_t kk = 0; kk < kGroup; ++kk) {
        vec wv[kVecs];
        weights(q, kk, d, mn, wv);
        for (int j = 0; j < kVecs; ++j) vstore(out + (g * kGroup + kk) * kBlock + kLanes * j, wv[j]);
      }
    }
  }

  // As Dense::tile, the same FMA chains (kChunk features each, in order): a group's
  // scales are loaded once and each feature's weights dequantized once in registers,
  // then used for every row of the tile.
  template <int M, int B>
  void tile(const float* x, int64_t k0, int64_t k1, int64_t blk, float* y, int64_t ldy,
            int64_t ncols) const {
    constexpr int V = kVecs * B;
    vec acc[M][V];
    zero<M, V>(acc);
    const int64_t bs = K / kGroup * kBytes;
    const uint8_t* wb = w + blk * bs;
    for (int64_t g = k0 / kGroup; g < k1 / kGroup; ++g) {
      vec d[V], mn[V];
      const uint8_t* q[B];
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b) {
        const uint8_t* p = wb + b * bs + g * kBytes;
        for (int64_t off = 0; off < kBytes; off += 64)  // two groups ahead
          _mm_prefetch((const char*)(p + 2 * kBytes + off), _MM_HINT_T0);
        const uint16_t* h = (const uint16_t*)p;
#pragma GCC unroll 4
        for (int j = 0; j < kVecs; ++j) {
          d[kVecs * b + j] = vload_f16(h + kLanes * j);
          if constexpr (kMin) mn[kVecs * b + j] = vload_f16(h + kBlock + kLanes * j);
          // Q4_0: (q - 8) * d as q * d + (-8 d), both exact, so one FMA rounds to it.
          if constexpr (F == kQ4_0) mn[kVecs * b + j] = vmul(d[kVecs * b + j], vset1(-8.0f));
        }
        q[b] = p + 2 * kBlock * (kMin ? 2 : 1);
      }
      const float* xg = x + g * kGroup;
      for (int64_t kk = 0; kk < kGroup; ++kk) {
        vec wv[V];
#pragma GCC unroll 4
        for (int b = 0; b < B; ++b) weights(q[b], kk, d + kVecs * b, mn + kVecs * b, wv + kVecs * b);
        fma_rows<M, V>(acc, xg + kk, K, wv);
      }
    }
    store<M, V>(acc, k0 == 0, k1 == K, nullptr, bias == nullptr ? nullptr : bias + blk * kBlock,
                y, ldy, ncols);
  }
};

template <typename Op, int B, int R>
inline void tile_rows(const Op& op, const float* x, int64_t m, int64_t k0, int64_t k1,
                      int64_t blk, float* y, int64_t N, int64_t ncols) {
  if constexpr (R > 1) {
    if (m < R) return tile_rows<Op, B, R - 1>(op, x, m, k0, k1, blk, y, N, ncols);
  }
  op.template tile<R, B>(x, k0, k1, blk, y, N, ncols);
}

template <typename Op, int B>
inline void rows(const Op& op, const float* x, int64_t M, int64_t blk, float* y, int64_t N,
                 int64_t ncols) {
  const int64_t K = op.K;
  for (int64_t m0 = 0; m0 < M; m0 += kRows) {
    const float* xm = x + m0 * K;
    float* ym = y + m0 * N;
    const int64_t m = M - m0 < kRows ? M - m0 : kRows;
    for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
      const int64_t k1 = K - k0 < kChunk ? K : k0 + kChunk;
      tile_rows<Op, B, kRows>(op, xm, m, k0, k1, blk, ym, N, ncols);
    }
  }
}

template <typename Op>
void linear(const Op& op, const float* x, int64_t M, int64_t N, float* y, int threads) {
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  // Few rows: two blocks per tile where registers allow, for more independent FMA
  // chains and weight streams.
  const int64_t per = M <= 4 && kMaxBlocksPerTile >= 2 ? 2 : 1;
  const int64_t tiles = (blocks + per - 1) / per;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t b = t * per;
    const int64_t ncols = N - b * kBlock;
    float* yb = y + b * kBlock;
    if constexpr (Op::kQuant) {
      // More rows than kScratchRows (prefill chunks; simd.h): dequantize the block
      // once into an L2-sized scratch and run the float32 tile over it, instead of once
      // per tile of rows. The same floats and FMA chains, so the same bits.
      if (M > kScratchRows) {
        thread_local std::vector<float> scratch;
        scratch.resize(op.K * kBlock);
        op.dequantize(b, scratch.data());
        const float* bb = op.bias == nullptr ? nullptr : op.bias + b * kBlock;
        rows<Dense<float>, 1>(Dense<float>{scratch.data(), nullptr, bb, op.K}, x, M, 0, yb, N, ncols);
        continue;
      }
    }
    if constexpr (kMaxBlocksPerTile >= 2) {
      if (per == 2 && b + 1 < blocks) {
        rows<Op, 2>(op, x, M, b, yb, N, ncols);
        continue;
      }
    }
    rows<Op, 1>(op, x, M, b, yb, N, ncols);
  }
}

}  // namespace

extern "C" int adaserve_skinny_block() { return (int)kBlock; }

// packed: float32, or int8 when scale (one float per output column, zero-padded like
// packed to whole blocks) is given.
extern "C" void adaserve_skinny_linear(const float* x, int64_t M, int64_t K, const void* packed,
                                       const float* scale, int64_t N, const float* bias, float* y,
                                       int threads) {
  if (scale == nullptr) linear(Dense<float>{(const float*)packed, nullptr, bias, K}, x, M, N, y, threads);
  else linear(Dense<int8_t>{(const int8_t*)packed, scale, bias, K}, x, M, N, y, threads);
}

// Bytes of one packed group (32 columns x 32 features) of ggml type `format`; 0 for a
// type this kernel does not take.
extern "C" int64_t adaserve_quant_group_bytes(int format) {
  switch (format) {
    case kQ4_0: return Quant<kQ4_0>::kBytes;
    case kQ4_1: return Quant<kQ4_1>::kBytes;
    case kQ8_0: return Quant<kQ8_0>::kBytes;
    default: return 0;
  }
}

// packed: [ceil(N / 32), K / 32, group bytes] of ggml type `format` (K a multiple of 32).
extern "C" void adaserve_quant_linear(const float* x, int64_t M, int64_t K, const void* packed,
                                      int format, int64_t N, const float* bias, float* y,
                                      int threads) {
  const uint8_t* w = (const uint8_t*)packed;
  switch (format) {
    case kQ4_0: return linear(Quant<kQ4_0>{w, bias, K}, x, M, N, y, threads);
    case kQ4_1: return linear(Quant<kQ4_1>{w, bias, K}, x, M, N, y, threads);
    case kQ8_0: return linear(Quant<kQ8_0>{w, bias, K}, x, M, N, y, threads);
  }
}
