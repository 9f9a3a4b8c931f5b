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

#define MAX_GROUP 16 /* query heads per KV head (decode_step.c checks these bounds too) */
#define MAX_DIM 256
#define PD_MAX_GROUP MAX_GROUP
#define PD_MAX_DIM MAX_DIM
#define PD_PAIR_(name) name##_pair
#define PD_PAIR(name) PD_PAIR_(name)

/* token i of block b, KV head h: head_dim values in the cache dtype */
#define PLAIN_ROW(which, b, i, LOAD)                                                                 \
  do {                                                                                            \
    const int64_t off_ = (b) * block_stride + (i) * token_stride + h * head_dim;                  \
    for (int64_t d = 0; d < head_dim; d++) row[d] = LOAD(which##_cache, off_ + d);                \
  } while (0)

#define PD_NAME paged_decode_f32
#define PD_T float
#define PD_LOAD load_f32
#define PD_STORE store_f32
#define PD_CACHE_PARAMS const float *k_cache, const float *v_cache
#define PD_CACHE_ARGS k_cache, v_cache
#define PD_READ_ROW(which, b, i) PLAIN_ROW(which, b, i, load_f32)
#define PD_ROW_SCALE(which, b, i) 1.0f /* x * 1.0f == x exactly: the results are unchanged */
#define PD_ROTATE(x)
#include "paged_decode_pair.h"

#define PD_NAME paged_decode_bf16
#define PD_T uint16_t
#define PD_LOAD load_bf16
#define PD_STORE store_bf16
#define PD_CACHE_PARAMS const uint16_t *k_cache, const uint16_t *v_cache
#define PD_CACHE_ARGS k_cache, v_cache
#define PD_READ_ROW(which, b, i) PLAIN_ROW(which, b, i, load_bf16)
#define PD_ROW_SCALE(which, b, i) 1.0f
#define PD_ROTATE(x)
#include "paged_decode_pair.h"
