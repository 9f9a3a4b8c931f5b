/* Scalar helpers of atlas_vlm/kernels/csrc/quant_gemm.c (shared by every ISA variant): fp16
 * scales, the activation rows quantized to int8 blocks (llama.cpp's Q8) with their unit sums,
 * and a tile's outputs stored. Included by quant_gemm.c (TILE, QBLOCK), not built on its own. */

/* ---- scalar helpers (shared by every variant) ------------------------------------------------ */

#include "half.h" /* f16_to_f32 */

static inline float load_scale(const void *p, int64_t i, int f16) {
  return f16 ? f16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline int32_t load_i32(const int8_t *p) {
  int32_t v;
  memcpy(&v, p, 4);
  return v;
}

/* Values a unit (an int32 sum's span): a block of 32, or a group of 16 (GGUF Q6_K / Q3_K / Q2_K). */
static inline int64_t unit_of(int64_t gs) { return gs < QBLOCK ? gs : QBLOCK; }

/* Quantize activation rows: xq [M][K], d [M][K/32], xs [M][K/U] (sum of xq per unit of
 * U = unit_of(gs)), xg [M][G] (fold of fma(d_b, xs_u, .) over each group's units, b u's block). */
static void quantize_rows(const void *x, int x_bf16, int64_t M, int64_t K, int64_t gs, int8_t *xq, float *d,
                          int32_t *xs, float *xg) {
  const int64_t nb = K / QBLOCK, U = unit_of(gs), nu = K / U, upg = gs / U, upb = QBLOCK / U;
  for (int64_t m = 0; m < M; m++) {
    for (int64_t b = 0; b < nb; b++) {
      float v[QBLOCK], amax = 0.0f;
      int bad = 0;
      for (int i = 0; i < QBLOCK; i++) {
        const int64_t k = m * K + b * QBLOCK + i;
        v[i] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[k]) : ((const float *)x)[k];
        const float a = fabsf(v[i]);
        bad |= !(a <= 3.402823466e38f); /* NaN or infinity */
        amax = a > amax ? a : amax;
      }
      const float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
      int8_t *q = xq + m * K + b * QBLOCK;
      for (int i = 0; i < QBLOCK; i++) q[i] = bad ? 0 : (int8_t)nearbyintf(v[i] * id);
      for (int64_t j = 0; j < upb; j++) {
        int32_t sum = 0;
        for (int64_t i = j * U; i < (j + 1) * U; i++) sum += q[i];
        xs[m * nu + b * upb + j] = sum;
      }
      d[m * nb + b] = bad ? NAN : db;
    }
    if (xg != NULL) {
      for (int64_t g = 0; g < K / gs; g++) {
        float acc = 0.0f;
        for (int64_t u = g * upg; u < (g + 1) * upg; u++) acc = fmaf(d[m * nb + u / upb], (float)xs[m * nu + u], acc);
        xg[m * (K / gs) + g] = acc;
      }
    }
  }
}

static inline void store_tile(void *out, int out_bf16, int64_t N, int64_t m, int64_t n0, const float *acc,
                             const float *bias) {
  for (int r = 0; r < TILE && n0 + r < N; r++) {
    const float v = bias != NULL ? acc[r] + bias[n0 + r] : acc[r];
    if (out_bf16)
      ((uint16_t *)out)[m * N + n0 + r] = f32_to_bf16(v);
    else
      ((float *)out)[m * N + n0 + r] = v;
  }
}
