/* bf16 <-> fp32 for the C kernels (round to nearest even; a NaN stays a quiet NaN), the same
 * bits as PyTorch's conversions. Included by quant_gemm.c, fused_ops.c, paged_decode.c. */
#ifndef ATLAS_BF16_H
#define ATLAS_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t f32_to_bf16(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? ((u >> 16) | 0x40u) : r);
}

static inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }
#endif
