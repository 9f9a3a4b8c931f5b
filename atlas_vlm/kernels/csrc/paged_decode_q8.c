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

#define PD_MAX_GROUP 16
#define PD_MAX_DIM 256
#define PD_PAIR_(name) name##_pair
#define PD_PAIR(name) PD_PAIR_(name)

/* token i of block b, KV head h: head_dim codes read through the table, times their scale */
#define Q8_ROW(which, b, i)                                                                          \
  do {                                                                                            \
    const uint8_t *codes_ = which##_cache + (b) * block_stride + (i) * token_stride + h * head_dim; \
    const float sc_ = f16_to_f32(which##_scale[((b) * block_size + (i)) * num_kv_heads + h]);      \
    for (int64_t d = 0; d < head_dim; d++) row[d] = table[codes_[d]] * sc_;                       \
  } while (0)

#define Q8_PARAMS                                                                                    \
  const uint8_t *k_cache, const uint8_t *v_cache, const uint16_t *k_scale, const uint16_t *v_scale, \
      const float *table

#define PD_NAME paged_decode_q8_f32
#define PD_T float
#define PD_LOAD load_f32
#define PD_STORE store_f32
#define PD_CACHE_PARAMS Q8_PARAMS
#define PD_CACHE_ARGS k_cache, v_cache, k_scale, v_scale, table
#define PD_READ_ROW Q8_ROW
#include "paged_decode_pair.h"

#define PD_NAME paged_decode_q8_bf16
#define PD_T uint16_t
#define PD_LOAD load_bf16
#define PD_STORE store_bf16
#define PD_CACHE_PARAMS Q8_PARAMS
#define PD_CACHE_ARGS k_cache, v_cache, k_scale, v_scale, table
#define PD_READ_ROW Q8_ROW
#include "paged_decode_pair.h"
