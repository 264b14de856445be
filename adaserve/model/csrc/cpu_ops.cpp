// The small per-layer ops of a CPU decode step or tree verification, where a handful
// of token rows makes torch's per-op dispatch (~5-10 us an op on a 2-core VM) cost
// more than the arithmetic: a layer's tree attention was ~25 torch ops (~250 us) and
// is one call here, an RMSNorm ~60 us and is a few here.
//
// Tree attention reads the paged KV cache in place (no gather) for every query of a
// forward: decode steps, tree nodes and prompt chunks alike. Per (query, KV head) it
// lists the keys the query sees, in position order, and computes over that list
// alone: the scores (one FMA chain per key, kLanes keys reduced at a time), their
// softmax (a lane-wise exp, summed in 16 fixed lanes by index in the list) and the
// weighted sum of values (one FMA chain per output, in list order). A query's output
// so depends only on its own q and the keys it sees, never on the other queries of
// the call, their number, or keys it may not see: a position gets the same bits in a
// prompt chunk of any length, as a tree node and as a plain decode step.
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

namespace {

using namespace adaserve;

constexpr int64_t kMaxGroup = 16;     // query heads per KV head
constexpr int64_t kMaxHeadDim = 256;  // floats
constexpr int64_t kAhead = 8;         // keys ahead to prefetch

// out[i] = out[i] * c + p * v[i]
inline void scale_add(float* out, float c, float p, const float* v, int64_t d) {
  const vec cv = vset1(c), pv = vset1(p);
  for (int64_t i = 0; i < d; i += kLanes)
    vstore(out + i, vfma(pv, vload(v + i), vmul(vload(out + i), cv)));
}

// Scaled scores q_g . k / sqrt(D) of the n keys at slots (cache rows `row` floats
// apart, this KV head's keys at offset 0) for the G query heads qh, into scores[g * ld
// + c], kLanes keys at a time, lanes past n -inf; m[g] their max. NV = D / kLanes (0:
// any). Each score is one FMA chain over D then a fixed tree over the lanes: a
// function of q and that key alone.
template <int NV>
inline void scores_of(const float* qh, int64_t G, int64_t D, const float* cache,
                      const int64_t* slots, int64_t n, int64_t row, float scale, float* scores,
                      int64_t ld, float* m) {
  const int64_t nv = NV > 0 ? NV : D / kLanes;
  const vec sv = vset1(scale), ninf = vset1(-INFINITY);
  vec mv[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) mv[g] = ninf;
  for (int64_t c0 = 0; c0 < n; c0 += kLanes) {
    const float* kp[kLanes];
    for (int s = 0; s < kLanes; ++s) {
      const int64_t c = c0 + kSumOrder[s];
      kp[s] = cache + slots[c < n ? c : c0] * row;  // past n: any key, masked below
    }
    const vmask valid = vmask_first(n - c0);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qh + g * D;
      vec w[kLanes / 2];  // the keys' FMA chains, reduced a pair at a time
#pragma GCC unroll 8
      for (int s = 0; s < kLanes; s += 2) {
        vec a0 = vmul(vload(qg), vload(kp[s])), a1 = vmul(vload(qg), vload(kp[s + 1]));
#pragma GCC unroll 8
        for (int64_t i = 1; i < nv; ++i) {
          const vec qi = vload(qg + i * kLanes);
          a0 = vfma(qi, vload(kp[s] + i * kLanes), a0);
          a1 = vfma(qi, vload(kp[s + 1] + i * kLanes), a1);
        }
        w[s / 2] = vsum_pair(a0, a1);
      }
      const vec r = vselect(valid, vmul(vsum_lanes_rest(w), sv), ninf);
      vstore(scores + g * ld + c0, r);
      mv[g] = vmax(mv[g], r);
    }
  }
  for (int64_t g = 0; g < G; ++g) {  // a max is exact: any order gives the same
    alignas(64) float lanes[kLanes];
    vstore(lanes, mv[g]);
    m[g] = -INFINITY;
    for (int s = 0; s < kLanes; ++s) m[g] = lanes[s] > m[g] ? lanes[s] : m[g];
  }
}

// out_h = inv[h] * sum_j p_h[j] * v_j over the n keys at slots, in order, for H heads
// (p_h = p + h * ld); the H * NV accumulators in registers, each value vector read
// once for all H heads. Each output is one FMA chain in key order whatever H is.
template <int NV, int H>
inline void weighted_sum(const float* p, int64_t ld, const float* values, const int64_t* slots,
                         int64_t n, int64_t row, const float* inv, float* out, int64_t D) {
  vec acc[H][NV];
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < NV; ++i) acc[h][i] = vzero();
  for (int64_t j = 0; j < n; ++j) {
    const float* v = values + slots[j] * row;
    if (j + kAhead < n) {  // the slots are a gather: no hardware prefetcher follows them
      const char* ahead = (const char*)(values + slots[j + kAhead] * row);
      for (int64_t b = 0; b < NV * kLanes * 4; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
    }
#pragma GCC unroll 16
    for (int i = 0; i < NV; ++i) {
      const vec vv = vload(v + i * kLanes);
#pragma GCC unroll 4
      for (int h = 0; h < H; ++h) acc[h][i] = vfma(vset1(p[h * ld + j]), vv, acc[h][i]);
    }
  }
  for (int h = 0; h < H; ++h) {
    const vec iv = vset1(inv[h]);
    for (int i = 0; i < NV; ++i) vstore(out + h * D + i * kLanes, vmul(acc[h][i], iv));
  }
}

// out = inv * sum_j p[j] * v_j, any D (a multiple of kLanes), one head.
inline void weighted_sum_any(const float* p, const float* values, const int64_t* slots,
                             int64_t n, int64_t row, int64_t D, float inv, float* out) {
  memset(out, 0, D * sizeof(float));
  for (int64_t j = 0; j < n; ++j) {
    scale_add(out, 1.0f, p[j], values + slots[j] * row, D);
  }
  scale_add(out, inv, 0.0f, out, D);
}

// The G heads' weighted sums, 3 heads per pass over the keys and at most 4 vectors
// of each (12 accumulators of 16 vector registers): a head of 8 vectors (AVX2, D 64)
// takes two passes of half its columns, so the values are read once per 3 heads. The
// 1 or 2 heads left take one pass each, all NV vectors (NV <= 8) in registers.
template <int NV>
inline void weighted_sums(const float* p, int64_t ld, const float* values, const int64_t* slots,
                          int64_t n, int64_t row, int64_t G, int64_t D, const float* inv,
                          float* out) {
  constexpr int kCols = NV > 4 ? 4 : NV;  // vectors per pass
  static_assert(NV % kCols == 0 && NV <= 8);
  int64_t g = 0;
  for (; g + 3 <= G; g += 3)
    for (int c = 0; c < NV; c += kCols)
      weighted_sum<kCols, 3>(p + g * ld, ld, values + c * kLanes, slots, n, row, inv + g,
                             out + g * D + c * kLanes, D);
  for (; g < G; ++g)
    weighted_sum<NV, 1>(p + g * ld, ld, values, slots, n, row, inv + g, out + g * D, D);
}

}  // namespace

// Returns 0, or -1 when the shapes are outside what this kernel takes (the caller
// then uses torch): head_dim a multiple of the vector width and at most 256, at most
// 16 query heads per KV head.
//
// q [T, H, D] with ldq floats between tokens; cache: this layer's [slots, 2, Hkv, D]
// (k | v); kv_new [T, 2, Hkv, D], ldkv floats between tokens, is written at
// slot_mapping [T] first. Query t belongs to sequence q_seq[t] and is row q_row[t] of
// it; sequence b's keys are kv_slots[b, 0 .. kv_len[b]) in position order; visible
// [B, Qmax, Lmax] (bytes; null: every key visible) says which keys a row sees.
// out [T, H, D].
extern "C" int adaserve_tree_attention(const float* q, int64_t ldq, int64_t T, int64_t H,
                                       int64_t D, float* cache, int64_t Hkv,
                                       const float* kv_new, int64_t ldkv,
                                       const int64_t* slot_mapping, const int64_t* q_seq,
                                       const int64_t* q_row, const int64_t* kv_slots,
                                       const int64_t* kv_len, int64_t Lmax,
                                       const uint8_t* visible, int64_t Qmax, float scale,
                                       float* out, int threads) {
  const int64_t G = Hkv > 0 ? H / Hkv : 0;
  if (D % kLanes != 0 || D > kMaxHeadDim || G < 1 || G > kMaxGroup || G * Hkv != H) return -1;
  const int64_t row = 2 * Hkv * D;  // floats per cache slot
  for (int64_t t = 0; t < T; ++t)
    memcpy(cache + slot_mapping[t] * row, kv_new + t * ldkv, row * sizeof(float));
#pragma omp parallel num_threads(threads)
  {
    // Per item (reused across items): the positions of the keys it sees, and the G
    // heads' scores of those keys, each row padded to whole 16-float steps.
    const int64_t ld = (Lmax + 15) / 16 * 16;
    int64_t* seen = (int64_t*)malloc(sizeof(int64_t) * Lmax);
    float* scores = (float*)malloc(sizeof(float) * G * ld);
#pragma omp for schedule(static)
    for (int64_t item = 0; item < T * Hkv; ++item) {
      const int64_t hk = item / T, t = item % T;  // a KV head's queries in a row: its keys stay in L2
      const int64_t b = q_seq[t], L = kv_len[b];
      const int64_t* slots = kv_slots + b * Lmax;
      const uint8_t* vis = visible == nullptr ? nullptr : visible + (b * Qmax + q_row[t]) * Lmax;
      const float* qh = q + t * ldq + hk * G * D;
      float* oh = out + (t * H + hk * G) * D;
      // The keys it sees, in position order: the n slots every pass below runs over,
      // so keys it may not see (later prompt tokens, other tree branches) take no part.
      int64_t n = 0;
      for (int64_t j = 0; j < L; ++j)
        if (vis == nullptr || vis[j]) seen[n++] = slots[j];
      // Pass 1: scaled scores and their max.
      float m[kMaxGroup];
      const float* keys = cache + hk * D;
      switch (D / kLanes) {
        case 4: scores_of<4>(qh, G, D, keys, seen, n, row, scale, scores, ld, m); break;
        case 8: scores_of<8>(qh, G, D, keys, seen, n, row, scale, scores, ld, m); break;
        default: scores_of<0>(qh, G, D, keys, seen, n, row, scale, scores, ld, m);
      }
      // Pass 2: softmax weights (the padding after the n scores is -inf: weight 0),
      // summed 16 at a time in fixed lanes (score c in lane c % 16) then across lanes.
      float inv[kMaxGroup];
      const int64_t n16 = (n + 15) / 16 * 16;
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores + g * ld;
        for (int64_t c = n; c < n16; ++c) sg[c] = -INFINITY;
        const vec mv = vset1(m[g]);
        vec acc[kWide];
        for (int w = 0; w < kWide; ++w) acc[w] = vzero();
        for (int64_t c = 0; c < n16; c += 16) {
          for (int w = 0; w < kWide; ++w) {
            const vec e = vexp(vsub(vload(sg + c + w * kLanes), mv));
            vstore(sg + c + w * kLanes, e);
            acc[w] = vadd(acc[w], e);
          }
        }
        inv[g] = 1.0f / vsum_wide(acc);  // every row sees at least itself: sum >= 1
      }
      // Pass 3: the weighted sums of the values, in position order.
      const float* values = cache + Hkv * D + hk * D;
      switch (D / kLanes) {  // the accumulators in registers for common head sizes
        case 4: weighted_sums<4>(scores, ld, values, seen, n, row, G, D, inv, oh); break;
        case 8: weighted_sums<8>(scores, ld, values, seen, n, row, G, D, inv, oh); break;
        default:
          for (int64_t g = 0; g < G; ++g)
            weighted_sum_any(scores + g * ld, values, seen, n, row, D, inv[g], oh + g * D);
      }
    }
    free(scores);
    free(seen);
  }
  return 0;
}

// y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, for T rows of D floats (the caller checks
// D).
// The sum of squares runs in 16 fixed lanes (element i in lane i % 16) on both builds,
// so the norm has the same bits on AVX2 and AVX-512, as the linear layers do (D a
// multiple of 16).
extern "C" void adaserve_rms_norm(const float* x, int64_t T, int64_t D, const float* w,
                                  float eps, float* y) {
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x + t * D;
    vec acc[kWide];
    for (int w = 0; w < kWide; ++w) acc[w] = vzero();
    for (int64_t i = 0; i < D; i += 16)
      for (int w = 0; w < kWide; ++w) {
        const vec v = vload(xt + i + w * kLanes);
        acc[w] = vfma(v, v, acc[w]);
      }
    const float r = 1.0f / sqrtf(vsum_wide(acc) / (float)D + eps);
    const vec rv = vset1(r);
    for (int64_t i = 0; i < D; i += kLanes) vstore(y + t * D + i, vmul(vmul(vload(xt + i), rv), vload(w + i)));
  }
}

namespace {

// IEEE half -> float, exactly (every half is a float).
float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023;
  uint32_t bits;
  if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);  // inf, nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal half: normal as a float
    int e = -1;
    uint32_t m = man;
    do {
      ++e;
      m <<= 1;
    } while ((m & 1024) == 0);
    bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 1023) << 13);
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace

// The dequantized weights of output columns cols[0 .. n) of a quantized layer's packed
// blocks (cpu_gemm.py's pack_gguf layout, or pack_gguf_i8's with i8), float32 [n,
// groups * 32]: ggml's own arithmetic (q * d, (q - 8) * d, q * d + m in float32), the
// values unpack_gguf_columns gives, for an embedding lookup of one decode step's
// tokens without its ~20 torch ops. format: 2 (Q4_0), 3 (Q4_1), 8 (Q8_0), 12 (Q4_K),
// 14 (Q6_K; both transcoded, float32 scales). Returns -1,
// writing nothing, where a column is not in [0, N).
extern "C" int adaserve_quant_columns(const uint8_t* packed, int64_t N, int64_t groups,
                                      int64_t group_bytes, int format, int i8,
                                      const int64_t* cols, int64_t n, float* out) {
  constexpr int64_t kBlock = 32, kHalf = 16;
  for (int64_t i = 0; i < n; ++i)
    if (cols[i] < 0 || cols[i] >= N) return -1;
  // A second scale vector: Q4_1's and Q4_K's minimum, Q6_K's scale of features 16-31.
  const bool has_min = format == 3 || format == 12 || format == 14;
  const bool int8_quants = format == 8 || format == 14;
  const int64_t scale_bytes = format == 12 || format == 14 ? 4 : 2;  // transcoded: float32
  const int64_t qoff = (has_min ? 2 : 1) * scale_bytes * kBlock;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t c = cols[i] % kBlock;
    const uint8_t* blk = packed + cols[i] / kBlock * groups * group_bytes;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* p = blk + g * group_bytes;
      float d, m = 0.0f;
      if (scale_bytes == 4) {
        memcpy(&d, p + 4 * c, 4);
        memcpy(&m, p + 4 * kBlock + 4 * c, 4);
      } else {
        uint16_t hd, hm = 0;
        memcpy(&hd, p + 2 * c, 2);
        if (has_min) memcpy(&hm, p + 2 * kBlock + 2 * c, 2);
        d = half_to_float(hd);
        m = half_to_float(hm);
      }
      const uint8_t* q = p + qoff;
      float* o = out + i * groups * kBlock + g * kBlock;
      for (int64_t f = 0; f < kBlock; ++f) {
        int v;
        if (int8_quants) {  // i8: [quad, col, 4]; else [feature, col]
          v = (int8_t)(i8 ? q[(f / 4) * kBlock * 4 + c * 4 + f % 4] : q[f * kBlock + c]);
        } else {  // nibbles: low for columns 0-15, high for 16-31
          const uint8_t b = i8 ? q[(f / 4) * kHalf * 4 + (c % kHalf) * 4 + f % 4]
                               : q[f * kHalf + c % kHalf];
          v = c < kHalf ? (b & 15) : (b >> 4);
          if (format == 2) v -= 8;
        }
        if (format == 14) o[f] = (float)v * (f < kHalf ? d : m);
        else o[f] = has_min ? (float)v * d + m : (float)v * d;
      }
    }
  }
  return 0;
}
