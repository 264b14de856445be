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
// And it takes GGUF's Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K blocks as stored (Quant below), dequantized
// exactly in registers once per feature and tile of rows, then the same FMA chains:
// the bits of the float32 kernel over the GGUF's dequantized weights; or with the
// activations quantized to int8 per group and integer dot products (QuantI8).
//
// Plain C ABI, no torch headers: it builds in about a second and is called through
// ctypes. Threads come from OpenMP; loaded into a process that imported torch, the
// soname libgomp.so.1 resolves to torch's own runtime and thread pool.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
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
//
// Q4_K arrives transcoded by cpu_gemm.py (q4_k_blocks): each 32-weight sub-block of a
// 256-weight super-block is q * (d * sc) - dmin * mn with 6-bit sc and mn, and both
// products are exact in float32 (a float16 times a 6-bit integer), so it is laid out as
// Q4_1 with those two as float32 scale and minimum (negated) in place of float16 ones:
// still ggml's values bit for bit, from 6 bits a weight where the file has 4.5.
//
// Q6_K likewise (q6_k_blocks): a weight is (q - 32) * (d * sc) with 6-bit q and an int8
// scale per 16 weights; d * sc is exact in float32 and so is its product with q - 32
// (18 + 6 significant bits), so a group is laid out as Q8_0 with int8 quants q - 32 and
// two float32 scales per column, the second for features 16-31 ("second head" below,
// where Q4_1 keeps its minimum): 10 bits a weight where the file has 6.6.
constexpr int64_t kGroup = 32;
enum Format : int { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14 };  // ggml_type ids

// A second scale vector per column after the first: Q4_1's minimum, Q6_K's scale of
// features 16-31.
template <int F>
constexpr bool kHasMin = F == kQ4_1 || F == kQ4_K || F == kQ6_K;
template <int F>
constexpr int64_t kScaleBytes = F == kQ4_K || F == kQ6_K ? 4 : 2;  // float32 or float16
template <int F>
constexpr bool kInt8Quants = F == kQ8_0 || F == kQ6_K;  // else nibbles

// The scales of kLanes columns from index i of a group's head.
template <int F>
inline vec load_scales(const uint8_t* head, int64_t i) {
  if constexpr (kScaleBytes<F> == 4) return vload((const float*)head + i);
  else return vload_f16((const uint16_t*)head + i);
}

template <int F>
struct Quant {
  static constexpr bool kQuant = true;
  static constexpr bool kMin = kHasMin<F>;
  static constexpr int64_t kQuantBytes = kInt8Quants<F> ? kGroup * kBlock : kGroup * kBlock / 2;
  static constexpr int64_t kHead = kScaleBytes<F> * kBlock * (kMin ? 2 : 1);
  static constexpr int64_t kBytes = kHead + kQuantBytes;  // per group
  const uint8_t* w;  // [blocks, K / 32, kBytes]
  const float* bias;
  int64_t K;

  // The 32 dequantized weights of feature kk of a group, as kVecs vectors.
  static inline void weights(const uint8_t* q, int64_t kk, const vec* d, const vec* mn, vec* out) {
    vec qv[kVecs];
    if constexpr (kInt8Quants<F>) {
      const int8_t* p = (const int8_t*)q + kk * kBlock;
      vcvt_i8x16(_mm_loadu_si128((const __m128i*)p), qv);
      vcvt_i8x16(_mm_loadu_si128((const __m128i*)(p + 16)), qv + kVecs / 2);
    } else {
      vcvt_nibbles(q + kk * kBlock / 2, qv);
    }
#pragma GCC unroll 4
    for (int j = 0; j < kVecs; ++j) {
      if constexpr (F == kQ8_0) out[j] = vmul(qv[j], d[j]);
      else if constexpr (F == kQ6_K) out[j] = vmul(qv[j], kk < kGroup / 2 ? d[j] : mn[j]);
      else out[j] = vfma(qv[j], d[j], mn[j]);
    }
  }

  // Column block `blk` dequantized into out [K, 32] (Dense<float>'s layout), the same
  // floats tile() makes in registers.
  void dequantize(int64_t blk, float* out) const {
    const uint8_t* p = w + blk * (K / kGroup * kBytes);
    for (int64_t g = 0; g < K / kGroup; ++g, p += kBytes) {
      vec d[kVecs], mn[kVecs];
      for (int j = 0; j < kVecs; ++j) {
        d[j] = load_scales<F>(p, kLanes * j);
        if constexpr (kMin) mn[j] = load_scales<F>(p, kBlock + kLanes * j);
        if constexpr (F == kQ4_0) mn[j] = vmul(d[j], vset1(-8.0f));
      }
      const uint8_t* q = p + kHead;
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
#pragma GCC unroll 4
        for (int j = 0; j < kVecs; ++j) {
          d[kVecs * b + j] = load_scales<F>(p, kLanes * j);
          if constexpr (kMin) mn[kVecs * b + j] = load_scales<F>(p, kBlock + kLanes * j);
          // Q4_0: (q - 8) * d as q * d + (-8 d), both exact, so one FMA rounds to it.
          if constexpr (F == kQ4_0) mn[kVecs * b + j] = vmul(d[kVecs * b + j], vset1(-8.0f));
        }
        q[b] = p + kHead;
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

// The int8-activation path (QuantLinear activations "int8"): each row of x quantized
// per group of 32 features to int8 with a float scale (ggml's Q8_1: dx = amax / 127,
// q = round(x / dx), and sx = dx * sum q), then per group and output the int32 dot
// product of the stored quants and the row's int8 quants, and in float32, in group
// order, acc = fma(dw * dx, isum, acc), then (Q4_1, and Q4_0 as min -8 dw) acc =
// fma(mw, sx, acc). A row's quantization and every output's chain depend on that row
// alone, and the integer sums are exact, so a row's result is the same bits for any
// number of rows and on either build.
//
// Layout (cpu_gemm.py pack_gguf_i8), per block of 32 columns and group: the columns'
// float16 d, (Q4_1) float16 m, then 8 quads of 4 features: Q4_* 64 bytes, byte b
// holding column b / 4's nibble for feature 4 * quad + b % 4 (low) and column
// 16 + b / 4's (high); Q8_0 128 bytes, byte b column b / 4's int8 for that feature.
struct RowQuant {
  std::vector<int8_t> q;  // [M, K]
  std::vector<float> d, s;  // [M, K / 32]: scale, scale * sum of the group's quants
  void run(const float* x, int64_t M, int64_t K) {
    const int64_t G = K / kGroup;
    q.resize(M * K);
    d.resize(M * G);
    s.resize(M * G);
    for (int64_t r = 0; r < M * G; ++r) {
      const float* xg = x + r * kGroup;
      float amax = 0.0f;
      for (int i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(xg[i]));
      const float dx = amax / 127.0f;
      const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
      int32_t sum = 0;
      for (int i = 0; i < kGroup; ++i) {
        const float v = std::nearbyint(xg[i] * id);
        const int32_t qi = (int32_t)std::min(127.0f, std::max(-127.0f, v));
        q[r * kGroup + i] = (int8_t)qi;
        sum += qi;
      }
      d[r] = dx;
      s[r] = dx * (float)sum;
    }
  }
};

template <int F>
struct QuantI8 {
  static constexpr bool kMin = !kInt8Quants<F>;  // Q4_0 as a minimum of -8 d
  static constexpr int64_t kHead = kScaleBytes<F> * kBlock * (kHasMin<F> ? 2 : 1);
  static constexpr int64_t kQuad = kInt8Quants<F> ? 4 * kBlock : 2 * kBlock;  // bytes
  static constexpr int64_t kBytes = kHead + kGroup / 4 * kQuad;
  const uint8_t* w;
  const float* bias;
  int64_t K;
  const RowQuant* xq;

  // Which kLanes columns the j-th int vector of a quad holds, in units of kLanes.
  static constexpr int col(int j) {
    if constexpr (kInt8Quants<F> || kVecs == 2) return j;
    else return (j & 1) * 2 + (j >> 1);  // AVX2 Q4: [lo 0-7, hi 16-23, lo 8-15, hi 24-31]
  }

  // Rows [m0, m0 + M) x the 32 columns of block blk.
  template <int M>
  void tile(int64_t m0, int64_t blk, float* y, int64_t ldy, int64_t ncols) const {
    alignas(64) float acc[M][kBlock];
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < kVecs; ++j) vstore(acc[m] + kLanes * j, vzero());
    const int64_t G = K / kGroup;
    const uint8_t* p = w + blk * G * kBytes;
    for (int64_t g = 0; g < G; ++g, p += kBytes) {
      for (int64_t off = 0; off < kBytes; off += 64)
        _mm_prefetch((const char*)(p + 2 * kBytes + off), _MM_HINT_T0);
      ivec is[M][kVecs], first[M][kVecs];  // first: Q6_K's sums over features 0-15
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
        for (int j = 0; j < kVecs; ++j) is[m][j] = izero();
      const uint8_t* qp = p + kHead;
#pragma GCC unroll 8
      for (int qd = 0; qd < kGroup / 4; ++qd, qp += kQuad) {
        if constexpr (F == kQ6_K) {
          if (qd == kGroup / 8) {  // the second half has its own scale
#pragma GCC unroll 16
            for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
              for (int j = 0; j < kVecs; ++j) {
                first[m][j] = is[m][j];
                is[m][j] = izero();
              }
          }
        }
        ivec wv[kVecs], sg[kVecs];
        if constexpr (kInt8Quants<F>) {
#pragma GCC unroll 4
          for (int j = 0; j < kVecs; ++j) {
            sg[j] = iload(qp + j * (kQuad / kVecs));
            wv[j] = iabs8(sg[j]);
          }
        } else {
#pragma GCC unroll 4
          for (int j = 0; j < kVecs / 2; ++j) {
            const ivec b = iload(qp + j * (kQuad / (kVecs / 2)));
            wv[2 * j] = inib_lo(b);
            wv[2 * j + 1] = inib_hi(b);
          }
        }
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
          int32_t x4;
          std::memcpy(&x4, xq->q.data() + (m0 + m) * K + g * kGroup + 4 * qd, 4);
          const ivec xb = iset1(x4);
#pragma GCC unroll 4
          for (int j = 0; j < kVecs; ++j)
            is[m][j] = idot(is[m][j], wv[j], kInt8Quants<F> ? isign8(xb, sg[j]) : xb);
        }
      }
      vec dw[kVecs], mw[kVecs];
#pragma GCC unroll 4
      for (int j = 0; j < kVecs; ++j) {
        dw[j] = load_scales<F>(p, kLanes * col(j));
        if constexpr (kHasMin<F>) mw[j] = load_scales<F>(p, kBlock + kLanes * col(j));
        if constexpr (F == kQ4_0) mw[j] = vmul(dw[j], vset1(-8.0f));
      }
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const vec dx = vset1(xq->d[(m0 + m) * G + g]);
        const vec sx = vset1(xq->s[(m0 + m) * G + g]);
#pragma GCC unroll 4
        for (int j = 0; j < kVecs; ++j) {
          float* a = acc[m] + kLanes * col(j);
          vec v = vload(a);
          if constexpr (F == kQ6_K) {
            v = vfma(vmul(dw[j], dx), icvt(first[m][j]), v);
            v = vfma(vmul(mw[j], dx), icvt(is[m][j]), v);
          } else {
            v = vfma(vmul(dw[j], dx), icvt(is[m][j]), v);
          }
          if constexpr (kMin) v = vfma(mw[j], sx, v);
          vstore(a, v);
        }
      }
    }
    for (int j = 0; j < kVecs; ++j) {
      const vmask mk = vmask_first(ncols - kLanes * j);
      if (!vmask_any(mk)) break;
      const vec bv = bias != nullptr ? vload_masked(mk, bias + blk * kBlock + kLanes * j) : vzero();
      for (int m = 0; m < M; ++m) {
        vec v = vload(acc[m] + kLanes * j);
        if (bias != nullptr) v = vadd(v, bv);
        vstore_masked(y + (m0 + m) * ldy + kLanes * j, mk, v);
      }
    }
  }

  template <int R>
  void tile_rows(int64_t m0, int64_t m, int64_t blk, float* y, int64_t ldy, int64_t ncols) const {
    if constexpr (R > 1) {
      if (m < R) return tile_rows<R - 1>(m0, m, blk, y, ldy, ncols);
    }
    tile<R>(m0, blk, y, ldy, ncols);
  }
};

template <int F>
void linear_i8(const uint8_t* w, const float* x, int64_t M, int64_t K, int64_t N,
               const float* bias, float* y, int threads) {
  RowQuant xq;
  xq.run(x, M, K);
  const QuantI8<F> op{w, bias, K, &xq};
  const int64_t blocks = (N + kBlock - 1) / kBlock;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t ncols = N - b * kBlock;
    float* yb = y + b * kBlock;
    for (int64_t m0 = 0; m0 < M; m0 += kI8Rows) {
      const int64_t m = M - m0 < kI8Rows ? M - m0 : kI8Rows;
      op.template tile_rows<kI8Rows>(m0, m, b, yb, N, ncols);
    }
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
    case kQ4_K: return Quant<kQ4_K>::kBytes;
    case kQ6_K: return Quant<kQ6_K>::kBytes;
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
    case kQ4_K: return linear(Quant<kQ4_K>{w, bias, K}, x, M, N, y, threads);
    case kQ6_K: return linear(Quant<kQ6_K>{w, bias, K}, x, M, N, y, threads);
  }
}

// The int8-activation path: packed in QuantI8's layout, group bytes from
// adaserve_quant_i8_group_bytes.
extern "C" int64_t adaserve_quant_i8_group_bytes(int format) {
  switch (format) {
    case kQ4_0: return QuantI8<kQ4_0>::kBytes;
    case kQ4_1: return QuantI8<kQ4_1>::kBytes;
    case kQ8_0: return QuantI8<kQ8_0>::kBytes;
    case kQ4_K: return QuantI8<kQ4_K>::kBytes;
    case kQ6_K: return QuantI8<kQ6_K>::kBytes;
    default: return 0;
  }
}

extern "C" void adaserve_quant_i8_linear(const float* x, int64_t M, int64_t K, const void* packed,
                                         int format, int64_t N, const float* bias, float* y,
                                         int threads) {
  const uint8_t* w = (const uint8_t*)packed;
  switch (format) {
    case kQ4_0: return linear_i8<kQ4_0>(w, x, M, K, N, bias, y, threads);
    case kQ4_1: return linear_i8<kQ4_1>(w, x, M, K, N, bias, y, threads);
    case kQ8_0: return linear_i8<kQ8_0>(w, x, M, K, N, bias, y, threads);
    case kQ4_K: return linear_i8<kQ4_K>(w, x, M, K, N, bias, y, threads);
    case kQ6_K: return linear_i8<kQ6_K>(w, x, M, K, N, bias, y, threads);
  }
}
