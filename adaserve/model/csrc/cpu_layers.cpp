// Every decoder layer of a one-rank fp32 CPU model in one call (cpu_layers.py).
//
// A 135M model's decode step is ~30 layers of ~13 small ops each. Driven from Python,
// each op costs 3-10 us of module dispatch, torch op overhead and ctypes argument
// conversion whatever its size: ~2 ms of a ~7.5 ms step on 2 cores, where llama.cpp's
// whole step is ~6.6 ms. Here a layer is plain calls into the same kernels (the
// linear layers of skinny_gemm.cpp, tree attention and RMSNorm of cpu_ops.cpp), with
// RoPE, the residual adds and SiLU-and-multiply written out beside them.
//
// Every step is a function of one token row alone (the attention of its own query
// and the keys it sees), in a fixed order of correctly rounded operations: a position
// gets the same bits in a prompt chunk, a tree verification or a decode step, as the
// tree attention already does.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

extern "C" {
void adaserve_skinny_linear(const float* x, int64_t M, int64_t K, const void* packed,
                            const float* scale, int64_t N, const float* bias, float* y,
                            int threads);
void adaserve_quant_linear(const float* x, int64_t M, int64_t K, const void* packed, int format,
                           int64_t N, const float* bias, float* y, int threads);
void adaserve_quant_i8_linear(const float* x, int64_t M, int64_t K, const void* packed,
                              int format, int64_t N, const float* bias, float* y, int threads);
int adaserve_tree_attention(const float* q, int64_t ldq, int64_t T, int64_t H, int64_t D,
                            float* cache, int64_t Hkv, const float* kv_new, int64_t ldkv,
                            const int64_t* slot_mapping, const int64_t* q_seq,
                            const int64_t* q_row, const int64_t* kv_slots,
                            const int64_t* kv_len, int64_t Lmax, const uint8_t* visible,
                            int64_t Qmax, float scale, float* out, int threads);
void adaserve_rms_norm(const float* x, int64_t T, int64_t D, const float* w, float eps,
                       float* y);
}

namespace {

using namespace adaserve;

// One linear layer as cpu_gemm.py's classes hold it (cpu_layers.py fills these).
enum Kind : int64_t { kPacked = 0, kQuant = 1, kQuantI8 = 2 };
struct Linear {
  int64_t kind;
  const void* weights;
  const float* scale;  // kPacked with int8 weights: one per output; else null
  int64_t format;      // kQuant, kQuantI8: the ggml block type
  const float* bias;   // null: none
  int64_t in, out;
};

struct Layer {
  const float* input_norm;
  const float* post_norm;
  Linear qkv, o, gate_up, down;
};

void linear(const Linear& l, const float* x, int64_t T, float* y, int threads) {
  switch (l.kind) {
    case kPacked:
      return adaserve_skinny_linear(x, T, l.in, l.weights, l.scale, l.out, l.bias, y, threads);
    case kQuant:
      return adaserve_quant_linear(x, T, l.in, l.weights, (int)l.format, l.out, l.bias, y,
                                   threads);
    case kQuantI8:
      return adaserve_quant_i8_linear(x, T, l.in, l.weights, (int)l.format, l.out, l.bias, y,
                                      threads);
  }
}

// Rotate the first `heads` heads of each of the T rows of x (ld floats apart) in place:
// pair (a, b) of head dimension D times cis = (c, s) of its token, as a complex
// multiply (the interleaved layout of layers.py's Rotary), each part one product then
// one fused multiply-add.
void rotate(float* x, int64_t ld, int64_t T, int64_t heads, int64_t D, const float* cis) {
  const int64_t half = D / 2;
  for (int64_t t = 0; t < T; ++t) {
    const float* r = cis + t * D;  // [D / 2] (c, s) pairs
    for (int64_t h = 0; h < heads; ++h) {
      float* p = x + t * ld + h * D;
      for (int64_t i = 0; i < half; ++i) {
        const float a = p[2 * i], b = p[2 * i + 1], c = r[2 * i], s = r[2 * i + 1];
        p[2 * i] = fmaf(a, c, -(b * s));
        p[2 * i + 1] = fmaf(a, s, b * c);
      }
    }
  }
}

// y[t, i] = silu(gu[t, i]) * gu[t, I + i] = g / (1 + exp(-g)) * u, for T rows (I a
// multiple of the vector width).
void silu_mul(const float* gu, int64_t T, int64_t I, float* y) {
  const vec one = vset1(1.0f);
  for (int64_t t = 0; t < T; ++t) {
    const float* g = gu + t * 2 * I;
    for (int64_t i = 0; i < I; i += kLanes) {
      const vec gv = vload(g + i);
      const vec s = vdiv(gv, vadd(one, vexp(vsub(vzero(), gv))));
      vstore(y + t * I + i, vmul(s, vload(g + I + i)));
    }
  }
}

void add_(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; i += kLanes) vstore(x + i, vadd(vload(x + i), vload(y + i)));
}

}  // namespace

// Run layers[0 .. L) over x [T, D] in place. H query heads and Hkv KV heads of Dh
// floats, I the MLP's intermediate size; D, Dh and I multiples of 16. cis [T, Dh / 2, 2]:
// each token's rotation. Layer l's paged KV cache is at cache + l * ld_cache; the other
// attention arguments are adaserve_tree_attention's. feats
// (may be null) [T, ld_feats]: the residual stream after layer l goes to columns
// feat_col[l] .. + D where feat_col[l] >= 0. Returns adaserve_tree_attention's refusal
// (nonzero) before touching x's values, or 0.
extern "C" int adaserve_decoder_layers(
    const Layer* layers, int64_t L, float* x, int64_t T, int64_t D, int64_t H, int64_t Hkv,
    int64_t Dh, int64_t I, float eps, const float* cis, float* cache, int64_t ld_cache,
    const int64_t* slot_mapping,
    const int64_t* q_seq, const int64_t* q_row, const int64_t* kv_slots, const int64_t* kv_len,
    int64_t Lmax, const uint8_t* visible, int64_t Qmax, float scale, float* feats,
    int64_t ld_feats, const int64_t* feat_col, int threads) {
  if (D % 16 || Dh % 16 || I % 16 || T < 1) return -2;
  const int64_t wq = (H + 2 * Hkv) * Dh;
  float* h = (float*)malloc(sizeof(float) * T * D);
  float* qkv = (float*)malloc(sizeof(float) * T * wq);
  float* att = (float*)malloc(sizeof(float) * T * H * Dh);
  float* out = (float*)malloc(sizeof(float) * T * D);
  float* gu = (float*)malloc(sizeof(float) * T * 2 * I);
  float* act = (float*)malloc(sizeof(float) * T * I);
  int rc = 0;
  for (int64_t l = 0; l < L && rc == 0; ++l) {
    const Layer& ly = layers[l];
    adaserve_rms_norm(x, T, D, ly.input_norm, eps, h);
    linear(ly.qkv, h, T, qkv, threads);
    rotate(qkv, wq, T, H + Hkv, Dh, cis);
    rc = adaserve_tree_attention(qkv, wq, T, H, Dh, cache + l * ld_cache, Hkv, qkv + H * Dh, wq,
                                 slot_mapping, q_seq, q_row, kv_slots, kv_len, Lmax, visible,
                                 Qmax, scale, att, threads);
    if (rc != 0) break;
    linear(ly.o, att, T, out, threads);
    add_(x, out, T * D);
    adaserve_rms_norm(x, T, D, ly.post_norm, eps, h);
    linear(ly.gate_up, h, T, gu, threads);
    silu_mul(gu, T, I, act);
    linear(ly.down, act, T, out, threads);
    add_(x, out, T * D);
    if (feats != nullptr && feat_col[l] >= 0)
      for (int64_t t = 0; t < T; ++t)
        memcpy(feats + t * ld_feats + feat_col[l], x + t * D, sizeof(float) * D);
  }
  free(act);
  free(gu);
  free(out);
  free(att);
  free(qkv);
  free(h);
  return rc;
}
