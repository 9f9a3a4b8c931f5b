/* Decode attention straight from 8-bit KV blocks (CPU), for atlas_vlm/kernels/decode_kernel.py.
 *
 * As paged_decode.c (one new query token per request; per (request, KV head) pair in
 * parallel; fp32 scores, softmax and accumulation; the output rounded once to q's dtype), but
 * the cache holds 8-bit codes with one float16 scale per (token, KV head)
 * (mm_kv_cache_management/kv_quant.py). A code is read through a 256-entry table of its value
 * (int8: the signed byte; fp8 e4m3: its float value), so one kernel serves both formats with
 * the same arithmetic as the PyTorch reference: value = table[code] * scale, in fp32.
 *
 * Shapes (row-major, contiguous):
 *   q            [num_seqs, num_heads, head_dim]                    fp32 or bf16
 *   k/v_cache    [num_blocks, block_size, num_kv_heads, head_dim]   uint8 codes (one layer)
 *   k/v_scale    [num_blocks, block_size, num_kv_heads]             float16 bits
 *   table        [256] fp32
 *   block_tables [num_seqs, table_stride] int64; context_lens [num_seqs] int64 (>= 1)
 *   out          [num_seqs, num_heads, head_dim]                    q's dtype
 * Returns 0, or -1 when a context does not fit its block table or a size is out of range.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(ATLAS_LIBMVEC)
extern float expf(float) __attribute__((__simd__("notinbranch")));
#endif

#define MAX_GROUP 16
#define MAX_DIM 256

/* IEEE half -> float (normals, subnormals, zeros, inf and NaN), exact. */
static inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1fu) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112u) << 23) | (man << 13);
  } else {
    float f = (float)man * 5.9604644775390625e-08f; /* man * 2^-24 */
    memcpy(&u, &f, 4);
    u |= sign;
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline float load_f32(const float *p, int64_t i) { return p[i]; }
static inline void store_f32(float *p, int64_t i, float x) { p[i] = x; }
static inline float load_bf16(const uint16_t *p, int64_t i) { return bf16_to_f32(p[i]); }
static inline void store_bf16(uint16_t *p, int64_t i, float x) { p[i] = f32_to_bf16(x); }

#define DEFINE_PAGED_DECODE_Q8(NAME, T, LOAD, STORE)                                                     \
  static int NAME##_pair(const T *q, const uint8_t *k_cache, const uint8_t *v_cache,                     \
                         const uint16_t *k_scale, const uint16_t *v_scale, const float *table,           \
                         const int64_t *block_tables, int64_t table_stride, const int64_t *context_lens, \
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,  \
                         float scale, T *out, int64_t s, int64_t h) {                                    \
    const int64_t group = num_heads / num_kv_heads;                                                      \
    const int64_t token_stride = num_kv_heads * head_dim;                                                \
    const int64_t block_stride = block_size * token_stride;                                              \
    const int64_t len = context_lens[s];                                                                 \
    const int64_t *bt = block_tables + s * table_stride;                                                 \
    if (len < 1 || (len + block_size - 1) / block_size > table_stride) return -1;                       \
    float qf[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM], row[MAX_DIM], mx[MAX_GROUP];                 \
    float *scores = (float *)malloc(sizeof(float) * group * len); /* [group, len] */                    \
    if (scores == NULL) return -1;                                                                       \
    for (int64_t g = 0; g < group; g++) {                                                                \
      const int64_t qoff = (s * num_heads + h * group + g) * head_dim;                                   \
      for (int64_t d = 0; d < head_dim; d++) qf[g][d] = LOAD(q, qoff + d) * scale;                       \
      for (int64_t d = 0; d < head_dim; d++) acc[g][d] = 0.0f;                                           \
      mx[g] = -INFINITY;                                                                                 \
    }                                                                                                    \
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {                                                   \
      const int64_t b = bt[t0 / block_size];                                                             \
      const uint8_t *kb = k_cache + b * block_stride + h * head_dim;                                     \
      const uint16_t *ks = k_scale + b * block_size * num_kv_heads + h;                                  \
      const int64_t n = len - t0 < block_size ? len - t0 : block_size;                                   \
      for (int64_t i = 0; i < n; i++) {                                                                  \
        const float sc = f16_to_f32(ks[i * num_kv_heads]);                                               \
        for (int64_t d = 0; d < head_dim; d++) row[d] = table[kb[i * token_stride + d]] * sc;            \
        for (int64_t g = 0; g < group; g++) {                                                            \
          float dot = 0.0f;                                                                              \
          _Pragma("omp simd reduction(+:dot)")                                                           \
          for (int64_t d = 0; d < head_dim; d++) dot += qf[g][d] * row[d];                               \
          scores[g * len + t0 + i] = dot;                                                                \
          if (dot > mx[g]) mx[g] = dot;                                                                  \
        }                                                                                                \
      }                                                                                                  \
    }                                                                                                    \
    float inv[MAX_GROUP];                                                                                \
    for (int64_t g = 0; g < group; g++) {                                                                \
      float sum = 0.0f;                                                                                  \
      float *sg = scores + g * len;                                                                      \
      const float m = mx[g];                                                                             \
      _Pragma("omp simd reduction(+:sum)")                                                               \
      for (int64_t t = 0; t < len; t++) {                                                                \
        const float e = expf(sg[t] - m);                                                                 \
        sg[t] = e;                                                                                       \
        sum += e;                                                                                        \
      }                                                                                                  \
      inv[g] = 1.0f / sum;                                                                               \
    }                                                                                                    \
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {                                                   \
      const int64_t b = bt[t0 / block_size];                                                             \
      const uint8_t *vb = v_cache + b * block_stride + h * head_dim;                                     \
      const uint16_t *vs = v_scale + b * block_size * num_kv_heads + h;                                  \
      const int64_t n = len - t0 < block_size ? len - t0 : block_size;                                   \
      for (int64_t i = 0; i < n; i++) {                                                                  \
        const float sc = f16_to_f32(vs[i * num_kv_heads]);                                               \
        for (int64_t d = 0; d < head_dim; d++) row[d] = table[vb[i * token_stride + d]] * sc;            \
        for (int64_t g = 0; g < group; g++) {                                                            \
          const float w = scores[g * len + t0 + i];                                                      \
          _Pragma("omp simd")                                                                            \
          for (int64_t d = 0; d < head_dim; d++) acc[g][d] += w * row[d];                                \
        }                                                                                                \
      }                                                                                                  \
    }                                                                                                    \
    for (int64_t g = 0; g < group; g++) {                                                                \
      const int64_t ooff = (s * num_heads + h * group + g) * head_dim;                                   \
      for (int64_t d = 0; d < head_dim; d++) STORE(out, ooff + d, acc[g][d] * inv[g]);                   \
    }                                                                                                    \
    free(scores);                                                                                        \
    return 0;                                                                                            \
  }                                                                                                      \
                                                                                                         \
  int NAME(const T *q, const uint8_t *k_cache, const uint8_t *v_cache, const uint16_t *k_scale,          \
           const uint16_t *v_scale, const float *table, const int64_t *block_tables,                     \
           int64_t table_stride, const int64_t *context_lens, int64_t num_seqs, int64_t num_heads,       \
           int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, T *out,              \
           int num_threads) {                                                                            \
    const int64_t group = num_heads / num_kv_heads;                                                      \
    if (head_dim > MAX_DIM || group > MAX_GROUP || group * num_kv_heads != num_heads) return -1;         \
    int status = 0;                                                                                      \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)")               \
    for (int64_t s = 0; s < num_seqs; s++) {                                                             \
      for (int64_t h = 0; h < num_kv_heads; h++) {                                                       \
        if (NAME##_pair(q, k_cache, v_cache, k_scale, v_scale, table, block_tables, table_stride,        \
                        context_lens, num_heads, num_kv_heads, head_dim, block_size, scale, out, s,      \
                        h) != 0) {                                                                       \
          _Pragma("omp atomic write")                                                                    \
          status = -1;                                                                                   \
        }                                                                                                \
      }                                                                                                  \
    }                                                                                                    \
    return status;                                                                                       \
  }

DEFINE_PAGED_DECODE_Q8(paged_decode_q8_f32, float, load_f32, store_f32)
DEFINE_PAGED_DECODE_Q8(paged_decode_q8_bf16, uint16_t, load_bf16, store_bf16)
