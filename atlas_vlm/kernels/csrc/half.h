/* IEEE half (fp16) -> float, exact (normals, subnormals, zeros, inf and NaN): the one scalar
 * conversion every kernel source includes (quant_gemm's scales, the 8-bit KV scales, GGUF blocks). */
#ifndef ATLAS_HALF_H
#define ATLAS_HALF_H

#include <stdint.h>
#include <string.h>

static inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
  if (exp == 0x1fu) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else { /* subnormal: normalise */
    exp = 113u;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      exp--;
    }
    u = sign | (exp << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}

#endif
