// The small per-layer ops of a CPU decode step or tree verification, where a handful
// of token rows makes torch's per-op dispatch (~5-10 us an op on a 2-core VM) cost
// more than the arithmetic: a layer's tree attention was ~25 torch ops (~250 us) and
// is one call here, an RMSNorm ~60 us and is a few here.
//
// Tree attention reads the paged KV cache in place (no gather) and skips keys a query
// may not see: per (query, head), scores of the visible keys, their softmax and the
// weighted sum of values, each in position order. A query's output so depends only on its own q and the keys it sees,
// never on the other queries of the call: a tree node gets the bits a plain decode
// step of the same token would.
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

namespace {

using namespace adaserve;

constexpr int64_t kMaxGroup = 16;     // query heads per KV head
constexpr int64_t kMaxHeadDim = 256;  // floats

inline float dot(const float* a, const float* b, int64_t d) {
  vec acc = vzero();
  for (int64_t i = 0; i < d; i += kLanes) acc = vfma(vload(a + i), vload(b + i), acc);
  return vsum(acc);
}

// out[i] = out[i] * c + p * v[i]
inline void scale_add(float* out, float c, float p, const float* v, int64_t d) {
  const vec cv = vset1(c), pv = vset1(p);
  for (int64_t i = 0; i < d; i += kLanes)
    vstore(out + i, vfma(pv, vload(v + i), vmul(vload(out + i), cv)));
}

// out = inv * sum_j p[j] * v_j over the visible keys j, in position order; NV vectors
// of accumulators kept in registers.
template <int NV>
inline void weighted_sum(const float* p, const float* values, const int64_t* slots,
                         const uint8_t* vis, int64_t L, int64_t row, float inv, float* out) {
  vec acc[NV];
  for (int i = 0; i < NV; ++i) acc[i] = vzero();
  for (int64_t j = 0; j < L; ++j) {
    if (vis != nullptr && !vis[j]) continue;
    const float* v = values + slots[j] * row;
    const vec pv = vset1(p[j]);
#pragma GCC unroll 16
    for (int i = 0; i < NV; ++i) acc[i] = vfma(pv, vload(v + i * kLanes), acc[i]);
  }
  const vec iv = vset1(inv);
  for (int i = 0; i < NV; ++i) vstore(out + i * kLanes, vmul(acc[i], iv));
}

inline void weighted_sum_any(const float* p, const float* values, const int64_t* slots,
                             const uint8_t* vis, int64_t L, int64_t row, int64_t D, float inv,
                             float* out) {
  memset(out, 0, D * sizeof(float));
  for (int64_t j = 0; j < L; ++j) {
    if (vis != nullptr && !vis[j]) continue;
    scale_add(out, 1.0f, p[j], values + slots[j] * row, D);
  }
  scale_add(out, inv, 0.0f, out, D);
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
    // Scores of this item's G heads over the sequence's keys (reused across items).
    float* scores = (float*)malloc(sizeof(float) * G * Lmax);
#pragma omp for schedule(static)
    for (int64_t item = 0; item < T * Hkv; ++item) {
      const int64_t t = item / Hkv, hk = item % Hkv;
      const int64_t b = q_seq[t], L = kv_len[b];
      const int64_t* slots = kv_slots + b * Lmax;
      const uint8_t* vis = visible == nullptr ? nullptr : visible + (b * Qmax + q_row[t]) * Lmax;
      const float* qh = q + t * ldq + hk * G * D;
      float* oh = out + (t * H + hk * G) * D;
      // Pass 1: scaled scores of the visible keys (-inf for the others) and their max.
      float m[kMaxGroup];
      for (int64_t g = 0; g < G; ++g) m[g] = -INFINITY;
      for (int64_t j = 0; j < L; ++j) {
        if (vis != nullptr && !vis[j]) {
          for (int64_t g = 0; g < G; ++g) scores[g * L + j] = -INFINITY;
          continue;
        }
        const float* k = cache + slots[j] * row + hk * D;
        for (int64_t g = 0; g < G; ++g) {
          const float s = dot(qh + g * D, k, D) * scale;
          scores[g * L + j] = s;
          m[g] = s > m[g] ? s : m[g];
        }
      }
      // Pass 2: softmax weights, summed in position order.
      float inv[kMaxGroup];
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores + g * L;
        float l = 0.0f;
        for (int64_t j = 0; j < L; ++j) {
          sg[j] = expf(sg[j] - m[g]);  // exp(-inf) = 0 for a key it may not see
          l += sg[j];
        }
        inv[g] = 1.0f / l;  // every row sees at least itself: l >= 1
      }
      // Pass 3: the weighted sum of the values, in position order.
      const float* values = cache + Hkv * D + hk * D;
      for (int64_t g = 0; g < G; ++g) {
        const float* pg = scores + g * L;
        switch (D / kLanes) {  // the accumulators in registers for common head sizes
          case 4: weighted_sum<4>(pg, values, slots, vis, L, row, inv[g], oh + g * D); break;
          case 8: weighted_sum<8>(pg, values, slots, vis, L, row, inv[g], oh + g * D); break;
          default: weighted_sum_any(pg, values, slots, vis, L, row, D, inv[g], oh + g * D);
        }
      }
    }
    free(scores);
  }
  return 0;
}

// y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, for T rows of D floats (D a multiple of
// the vector width; the caller checks).
extern "C" void adaserve_rms_norm(const float* x, int64_t T, int64_t D, const float* w,
                                  float eps, float* y) {
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x + t * D;
    const float r = 1.0f / sqrtf(dot(xt, xt, D) / (float)D + eps);
    const vec rv = vset1(r);
    for (int64_t i = 0; i < D; i += kLanes) vstore(y + t * D + i, vmul(vmul(vload(xt + i), rv), vload(w + i)));
  }
}
