/* Decode attention straight from KV blocks (CPU), for atlas_vlm/kernels/decode_kernel.py.
 *
 * One new query token per request. For every (request, KV head) pair, in parallel (OpenMP):
 * the query heads that share the KV head are read once into fp32 (scaled), every context
 * token's key is read from its block through the request's block table (no gather, no
 * padding), scores are kept in fp32, softmax in fp32, and the values are accumulated in
 * fp32; the output is rounded once to the cache dtype (bf16: round to nearest even).
 *
 * Shapes (row-major, contiguous):
 *   q            [num_seqs, num_heads, head_dim]
 *   k/v_cache    [num_blocks, block_size, num_kv_heads, head_dim]   (one layer)
 *   block_tables [num_seqs, table_stride] int64; context_lens [num_seqs] int64 (>= 1)
 *   out          [num_seqs, num_heads, head_dim]
 * Query head h reads KV head h / (num_heads / num_kv_heads), as HF's repeat_kv.
 * Returns 0, or -1 when a request's context does not fit in its block table or a size is
 * out of the supported range (head_dim <= 256, group <= 16): nothing is written then for
 * that pair and the caller falls back.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(ATLAS_LIBMVEC)
/* glibc's libmvec has vector expf (AVX2: _ZGVdN8v_expf); math.h declares it only under
 * -ffast-math, which this file does not use (it relies on -inf and NaN). Declare it here. */
extern float expf(float) __attribute__((__simd__("notinbranch")));
#endif

#define MAX_GROUP 16
#define MAX_DIM 256

static inline float load_f32(const float *p, int64_t i) { return p[i]; }
static inline void store_f32(float *p, int64_t i, float x) { p[i] = x; }

static inline float load_bf16(const uint16_t *p, int64_t i) {
  uint32_t u = (uint32_t)p[i] << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline void store_bf16(uint16_t *p, int64_t i, float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) { /* NaN stays NaN */
    p[i] = (uint16_t)((u >> 16) | 0x40u);
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
  p[i] = (uint16_t)(u >> 16);
}

/* One (request s, KV head h) pair: its query heads against its context. Returns 0, or -1 when
 * the context does not fit the block table or scratch memory is missing (nothing written). */
#define DEFINE_PAGED_DECODE(NAME, T, LOAD, STORE)                                                        \
  static int NAME##_pair(const T *q, const T *k_cache, const T *v_cache, const int64_t *block_tables,    \
                         int64_t table_stride, const int64_t *context_lens, int64_t num_heads,           \
                         int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, T *out, \
                         int64_t s, int64_t h) {                                                         \
    const int64_t group = num_heads / num_kv_heads;                                                      \
    const int64_t token_stride = num_kv_heads * head_dim;                                                \
    const int64_t block_stride = block_size * token_stride;                                              \
    const int64_t len = context_lens[s];                                                                 \
    const int64_t *table = block_tables + s * table_stride;                                              \
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
    /* scores = q . k for every context token, read block by block */                                  \
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {                                                   \
      const T *kb = k_cache + table[t0 / block_size] * block_stride + h * head_dim;                      \
      const int64_t n = len - t0 < block_size ? len - t0 : block_size;                                   \
      for (int64_t i = 0; i < n; i++) {                                                                  \
        for (int64_t d = 0; d < head_dim; d++) row[d] = LOAD(kb, i * token_stride + d);                  \
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
      _Pragma("omp simd reduction(+:sum)") /* vector expf (libmvec) with -fno-math-errno */              \
      for (int64_t t = 0; t < len; t++) {                                                                \
        const float e = expf(sg[t] - m);                                                                 \
        sg[t] = e;                                                                                       \
        sum += e;                                                                                        \
      }                                                                                                  \
      inv[g] = 1.0f / sum;                                                                               \
    }                                                                                                    \
    /* out = softmax . v */                                                                              \
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {                                                   \
      const T *vb = v_cache + table[t0 / block_size] * block_stride + h * head_dim;                      \
      const int64_t n = len - t0 < block_size ? len - t0 : block_size;                                   \
      for (int64_t i = 0; i < n; i++) {                                                                  \
        for (int64_t d = 0; d < head_dim; d++) row[d] = LOAD(vb, i * token_stride + d);                  \
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
  int NAME(const T *q, const T *k_cache, const T *v_cache, const int64_t *block_tables,                  \
           int64_t table_stride, const int64_t *context_lens, int64_t num_seqs, int64_t num_heads,       \
           int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, T *out,              \
           int num_threads) {                                                                            \
    const int64_t group = num_heads / num_kv_heads;                                                      \
    if (head_dim > MAX_DIM || group > MAX_GROUP || group * num_kv_heads != num_heads) return -1;         \
    int status = 0;                                                                                      \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)")               \
    for (int64_t s = 0; s < num_seqs; s++) {                                                             \
      for (int64_t h = 0; h < num_kv_heads; h++) {                                                       \
        if (NAME##_pair(q, k_cache, v_cache, block_tables, table_stride, context_lens, num_heads,        \
                        num_kv_heads, head_dim, block_size, scale, out, s, h) != 0) {                    \
          _Pragma("omp atomic write")                                                                    \
          status = -1;                                                                                   \
        }                                                                                                \
      }                                                                                                  \
    }                                                                                                    \
    return status;                                                                                       \
  }

DEFINE_PAGED_DECODE(paged_decode_f32, float, load_f32, store_f32)
DEFINE_PAGED_DECODE(paged_decode_bf16, uint16_t, load_bf16, store_bf16)
