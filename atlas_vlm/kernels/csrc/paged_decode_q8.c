/* Decode attention straight from 8-bit KV blocks (CPU), for atlas_vlm/kernels/decode_kernel.py.
 *
 * As paged_decode.c (one new query token per request; per (request, KV head) pair in
 * parallel; fp32 scores, softmax and accumulation; the output rounded once to q's dtype), but
 * the cache holds 8-bit codes of K and V rotated by the normalized Walsh-Hadamard matrix H,
 * with one float16 scale per (token, KV head) (mm_kv_cache_management/kv_quant.py). So:
 *   - q is rotated once (qH, after the softmax scale): q.k = (qH).(kH), and the output once
 *     (sum_i p_i v_i = (sum_i p_i v_i H) H, H symmetric and its own inverse), by an in-place
 *     fast Walsh-Hadamard transform over blocks of the largest power of two dividing head_dim;
 *   - a code is converted straight to float (int8: the signed byte; fp8 e4m3: a 256-entry
 *     table of its value), and the token's scale multiplies the q.k dot product once (K) and
 *     its softmax weight once (V), not every element.
 * The same values as the PyTorch reference (dequantize, rotate back, SDPA) up to fp32 rounding.
 *
 * Shapes (row-major, contiguous):
 *   q            [num_seqs, num_heads, head_dim]                    fp32 or bf16
 *   k/v_cache    [num_blocks, block_size, num_kv_heads, head_dim]   8-bit codes (one layer)
 *   k/v_scale    [num_blocks, block_size, num_kv_heads]             float16 bits
 *   table        [256] fp32 (fp8 variants; the int8 ones ignore it)
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

#include "half.h" /* f16_to_f32 */

static inline float load_f32(const float *p, int64_t i) { return p[i]; }
static inline void store_f32(float *p, int64_t i, float x) { p[i] = x; }
static inline float load_bf16(const uint16_t *p, int64_t i) { return bf16_to_f32(p[i]); }
static inline void store_bf16(uint16_t *p, int64_t i, float x) { p[i] = f32_to_bf16(x); }

/* HAD16[b][c] = (-1)^popcount(b & c): the unnormalized 16 x 16 Walsh-Hadamard matrix. */
static float HAD16[16][16];

__attribute__((constructor)) static void init_had16(void) {
  for (int b = 0; b < 16; b++)
    for (int c = 0; c < 16; c++) HAD16[b][c] = (__builtin_popcount(b & c) & 1) ? -1.0f : 1.0f;
}

/* x[0..head_dim) <- x H, H the normalized Walsh-Hadamard matrix of n = the largest power of two
 * dividing head_dim, block-diagonal over the row (kv_quant.hadamard_rotate). H_n = H_{n/m} (x)
 * H_m with m = min(n, 16): a dense H_m on each run of m values (m broadcast multiply-adds of a
 * vector, where a butterfly of a stride under the vector width would not vectorize), then the
 * butterflies of strides m, 2m, ... across runs. */
static void hadamard_rotate(float *x, int64_t head_dim) {
  const int64_t n = head_dim & -head_dim;
  if (n == 1) return;
  const int64_t m = n < 16 ? n : 16;
  const float norm = 1.0f / sqrtf((float)n);
  for (int64_t r = 0; r < head_dim; r += m) {
    float tmp[16] = {0};
    float *xr = x + r;
    if (m == 16) {
      for (int b = 0; b < 16; b++) {
        const float xb = xr[b];
#pragma omp simd
        for (int c = 0; c < 16; c++) tmp[c] += xb * HAD16[b][c];
      }
    } else {
      for (int64_t b = 0; b < m; b++)
        for (int64_t c = 0; c < m; c++) tmp[c] += xr[b] * HAD16[b][c];
    }
    for (int64_t c = 0; c < m; c++) xr[c] = tmp[c] * norm;
  }
  for (int64_t base = 0; base < head_dim; base += n) {
    float *xb = x + base;
    for (int64_t len = m; len < n; len <<= 1) {
      for (int64_t i = 0; i < n; i += len << 1) {
#pragma omp simd
        for (int64_t j = i; j < i + len; j++) {
          const float a = xb[j], b = xb[j + len];
          xb[j] = a + b;
          xb[j + len] = a - b;
        }
      }
    }
  }
}

#define PD_MAX_GROUP 16
#define PD_MAX_DIM 256
#define PD_PAIR_(name) name##_pair
#define PD_PAIR(name) PD_PAIR_(name)

/* token i of block b, KV head h: its head_dim codes as floats (the scale comes apart) */
#define Q8_CODES(which, b, i) (which##_cache + (b) * block_stride + (i) * token_stride + h * head_dim)
#define I8_ROW(which, b, i)                                                                          \
  do {                                                                                            \
    const int8_t *codes_ = (const int8_t *)Q8_CODES(which, b, i);                                 \
    (void)table; /* int8 needs no table */                                                        \
    for (int64_t d = 0; d < head_dim; d++) row[d] = (float)codes_[d];                             \
  } while (0)
#define FP8_ROW(which, b, i)                                                                         \
  do {                                                                                            \
    const uint8_t *codes_ = Q8_CODES(which, b, i);                                                \
    for (int64_t d = 0; d < head_dim; d++) row[d] = table[codes_[d]];                             \
  } while (0)
#define Q8_SCALE(which, b, i) f16_to_f32(which##_scale[((b) * block_size + (i)) * num_kv_heads + h])

#define Q8_PARAMS                                                                                    \
  const uint8_t *k_cache, const uint8_t *v_cache, const uint16_t *k_scale, const uint16_t *v_scale, \
      const float *table
#define Q8_ARGS k_cache, v_cache, k_scale, v_scale, table

#define PD_NAME paged_decode_i8_f32
#define PD_T float
#define PD_LOAD load_f32
#define PD_STORE store_f32
#define PD_CACHE_PARAMS Q8_PARAMS
#define PD_CACHE_ARGS Q8_ARGS
#define PD_READ_ROW I8_ROW
#define PD_ROW_SCALE Q8_SCALE
#define PD_ROTATE(x) hadamard_rotate(x, head_dim)
#include "paged_decode_pair.h"

#define PD_NAME paged_decode_i8_bf16
#define PD_T uint16_t
#define PD_LOAD load_bf16
#define PD_STORE store_bf16
#define PD_CACHE_PARAMS Q8_PARAMS
#define PD_CACHE_ARGS Q8_ARGS
#define PD_READ_ROW I8_ROW
#define PD_ROW_SCALE Q8_SCALE
#define PD_ROTATE(x) hadamard_rotate(x, head_dim)
#include "paged_decode_pair.h"

#define PD_NAME paged_decode_fp8_f32
#define PD_T float
#define PD_LOAD load_f32
#define PD_STORE store_f32
#define PD_CACHE_PARAMS Q8_PARAMS
#define PD_CACHE_ARGS Q8_ARGS
#define PD_READ_ROW FP8_ROW
#define PD_ROW_SCALE Q8_SCALE
#define PD_ROTATE(x) hadamard_rotate(x, head_dim)
#include "paged_decode_pair.h"

#define PD_NAME paged_decode_fp8_bf16
#define PD_T uint16_t
#define PD_LOAD load_bf16
#define PD_STORE store_bf16
#define PD_CACHE_PARAMS Q8_PARAMS
#define PD_CACHE_ARGS Q8_ARGS
#define PD_READ_ROW FP8_ROW
#define PD_ROW_SCALE Q8_SCALE
#define PD_ROTATE(x) hadamard_rotate(x, head_dim)
#include "paged_decode_pair.h"

/* float -> IEEE half, round to nearest even, for a scale already clamped to half's normal range
 * [2^-14, 65504] (NaN -> 0x7e00, as torch's conversion). */
static inline uint16_t scale_to_f16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7e00u;
  const uint32_t man = u & 0x7fffffu, rest = man & 0x1fffu;
  uint32_t h = ((((u >> 23) & 0xffu) - 112u) << 10) | (man >> 13); /* exponent rebiased 127 -> 15 */
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;       /* a carry moves into the exponent */
  return (uint16_t)h;
}

/* Store new tokens' K and V in an int8 cache, the same codes and scales as
 * kv_quant.quantize_per_token_head (whose rotation the caller has applied):
 *   rows       [2, num_tokens, num_kv_heads, head_dim] fp32: K then V, already rotated
 *   slots      [num_tokens] int64 flat slots, each < num_slots
 *   k/v_codes  [num_slots, num_kv_heads, head_dim] int8; k/v_scale [num_slots, num_kv_heads] float16 bits
 * Per row: s = half(clamp(amax|x| / 127, 2^-14, 65504)), codes = clamp(rint(x / s), -127, 127),
 * all in fp32 (IEEE: bit-identical to the PyTorch ops). Returns 0, or -1 for a slot out of range
 * (nothing written). */
int quantize_store_i8(const float *rows, const int64_t *slots, int64_t num_tokens, int64_t num_kv_heads,
                      int64_t head_dim, int64_t num_slots, int8_t *k_codes, int8_t *v_codes, uint16_t *k_scale,
                      uint16_t *v_scale) {
  for (int64_t t = 0; t < num_tokens; t++)
    if (slots[t] < 0 || slots[t] >= num_slots) return -1;
  for (int64_t r = 0; r < 2 * num_tokens * num_kv_heads; r++) { /* r = (which, token, head) */
    const int64_t which = r / (num_tokens * num_kv_heads), t = (r / num_kv_heads) % num_tokens, h = r % num_kv_heads;
    const float *x = rows + r * head_dim;
    float amax = 0.0f;
    for (int64_t d = 0; d < head_dim; d++) amax = fmaxf(amax, fabsf(x[d]));
    float s = amax / 127.0f;
    s = s < 0x1p-14f ? 0x1p-14f : (s > 65504.0f ? 65504.0f : s);
    const uint16_t half = scale_to_f16(s);
    const float sf = f16_to_f32(half);
    const int64_t at = slots[t] * num_kv_heads + h;
    int8_t *out = (which ? v_codes : k_codes) + at * head_dim;
    for (int64_t d = 0; d < head_dim; d++) {
      const float y = nearbyintf(x[d] / sf);
      out[d] = (int8_t)(y < -127.0f ? -127.0f : (y > 127.0f ? 127.0f : y));
    }
    (which ? v_scale : k_scale)[at] = half;
  }
  return 0;
}
