/* The decoder's small per-layer ops fused for CPU, for atlas_vlm/kernels/fused.py.
 *
 * Each function does in one call what the PyTorch reference in fused.py does in several
 * ops, with the same roundings to the tensor dtype (fp32 or bf16, round to nearest even) at
 * the same points; only fp32 reduction order and libm's expf may differ (tested bounds).
 *
 *   rms_norm      out = w * to_dtype(x * rsqrt(mean(x^2) + eps))         (HF LlamaRMSNorm)
 *                 with residual: residual = to_dtype(residual + x) first, normalised instead of x
 *   silu_mul      out = to_dtype(to_dtype(silu(g)) * u)                   (SwiGLU, gate | up halves)
 *   rope_kv       q, k = rotate(q_norm(q)), rotate(k_norm(k)) (HF rotate_half form, each step
 *                 rounded as PyTorch's x * cos + rotate_half(x) * sin); q to q_out, k and v
 *                 written to their cache slots
 *
 * Shapes (row-major, contiguous): x, residual, out [T, D]; gu [T, 2I], out [T, I];
 * qkv [T, (H + 2 KV) * Dh]; cos, sin [T, Dh] (the dtype); q_out [T, H, Dh];
 * k_cache, v_cache (one layer) [num_slots, KV, Dh]; slots [T] int64, each in [0, num_slots).
 * Every function returns 0, or -1 when a size is out of range (nothing written then).
 * The loops are written so that the compiler vectorises them (no branches inside; the bf16
 * conversions are integer arithmetic).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(ATLAS_LIBMVEC)
/* glibc's vector expf (libmvec); math.h declares it only under -ffast-math. */
extern float expf(float) __attribute__((__simd__("notinbranch")));
#endif

#define MAX_ROW 16384
#define MAX_HEAD_DIM 1024

/* Load n values of a row (fp32 or bf16) into fp32; store fp32 into a row of the dtype. */
static inline void load_row(const void *p, int64_t off, int64_t n, int bf16, float *v) {
  if (bf16) {
    const uint16_t *s = (const uint16_t *)p + off;
    for (int64_t i = 0; i < n; i++) v[i] = bf16_to_f32(s[i]);
  } else {
    memcpy(v, (const float *)p + off, sizeof(float) * (size_t)n);
  }
}

static inline void store_row(void *p, int64_t off, int64_t n, int bf16, const float *v) {
  if (bf16) {
    uint16_t *d = (uint16_t *)p + off;
    for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(v[i]);
  } else {
    memcpy((float *)p + off, v, sizeof(float) * (size_t)n);
  }
}

static inline void round_row(float *v, int64_t n, int bf16) { /* the values once stored in the dtype */
  if (bf16)
    for (int64_t i = 0; i < n; i++) v[i] = round_bf16(v[i]);
}

/* v[D] (values of the dtype) -> out = w * to_dtype(v * rsqrt(mean(v^2) + eps)), in v */
static inline void norm_row(float *v, const float *w, int64_t D, float eps, int bf16) {
  double ss = 0.0; /* fp64 sum of squares */
#pragma omp simd reduction(+ : ss)
  for (int64_t d = 0; d < D; d++) ss += (double)v[d] * (double)v[d];
  const float r = 1.0f / sqrtf((float)(ss / (double)D) + eps);
  for (int64_t d = 0; d < D; d++) v[d] *= r;
  round_row(v, D, bf16);
  for (int64_t d = 0; d < D; d++) v[d] = w[d] * v[d];
}

int rms_norm(const void *x, void *residual, const void *w, int64_t T, int64_t D, float eps, void *out, int bf16,
             int num_threads) {
  if (T < 1 || D < 1 || D > MAX_ROW) return -1;
  float wf[MAX_ROW];
  load_row(w, 0, D, bf16, wf);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && T > 4)
  for (int64_t t = 0; t < T; t++) {
    float v[MAX_ROW], r[MAX_ROW];
    load_row(x, t * D, D, bf16, v);
    if (residual != NULL) {
      load_row(residual, t * D, D, bf16, r);
      for (int64_t d = 0; d < D; d++) v[d] += r[d];
      round_row(v, D, bf16);
      store_row(residual, t * D, D, bf16, v);
    }
    norm_row(v, wf, D, eps, bf16);
    store_row(out, t * D, D, bf16, v);
  }
  return 0;
}

int silu_mul(const void *gu, int64_t T, int64_t I, void *out, int bf16, int num_threads) {
  if (T < 1 || I < 1 || I > MAX_ROW) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && T > 4)
  for (int64_t t = 0; t < T; t++) {
    float g[MAX_ROW], u[MAX_ROW];
    load_row(gu, t * 2 * I, I, bf16, g);
    load_row(gu, t * 2 * I + I, I, bf16, u);
#pragma omp simd
    for (int64_t i = 0; i < I; i++) g[i] = g[i] / (1.0f + expf(-g[i]));
    round_row(g, I, bf16);
    for (int64_t i = 0; i < I; i++) g[i] = g[i] * u[i];
    store_row(out, t * I, I, bf16, g);
  }
  return 0;
}

/* One head of row t: optional RMSNorm over Dh, then RoPE, stored at dst[d_off]. */
static inline void rope_head(const void *src, int64_t s_off, const float *norm_w, float eps, const float *cs,
                             const float *sn, int64_t Dh, void *dst, int64_t d_off, int bf16) {
  float v[MAX_HEAD_DIM], rot[MAX_HEAD_DIM];
  load_row(src, s_off, Dh, bf16, v);
  if (norm_w != NULL) {
    norm_row(v, norm_w, Dh, eps, bf16);
    round_row(v, Dh, bf16); /* the reference's RMSNorm output is a tensor of the dtype */
  }
  const int64_t half = Dh / 2;
  for (int64_t d = 0; d < half; d++) rot[d] = -v[d + half];
  for (int64_t d = half; d < Dh; d++) rot[d] = v[d - half];
  for (int64_t d = 0; d < Dh; d++) v[d] = v[d] * cs[d];
  round_row(v, Dh, bf16);
  for (int64_t d = 0; d < Dh; d++) rot[d] = rot[d] * sn[d];
  round_row(rot, Dh, bf16);
  for (int64_t d = 0; d < Dh; d++) v[d] = v[d] + rot[d];
  store_row(dst, d_off, Dh, bf16, v);
}

/* Row t, KV head kh: its query heads (kh * group ...) and its key rotated, with the q / k norms
 * where qn / kn (fp32 weights) are given; q to q_out, K and V to cache slot `slot`. c, s: row t's
 * cos / sin in fp32. Also the one-call decode step's (decode_step.c). */
static void rope_kv_pair(const void *qkv, const float *c, const float *s, const float *qn, const float *kn, float eps,
                         int64_t t, int64_t kh, int64_t H, int64_t KV, int64_t Dh, void *q_out, void *k_cache,
                         void *v_cache, int64_t slot, int bf16) {
  const int64_t group = H / KV, row = (H + 2 * KV) * Dh, esz = bf16 ? 2 : 4;
  for (int64_t g = 0; g < group; g++) {
    const int64_t head = kh * group + g;
    rope_head(qkv, t * row + head * Dh, qn, eps, c, s, Dh, q_out, (t * H + head) * Dh, bf16);
  }
  rope_head(qkv, t * row + (H + kh) * Dh, kn, eps, c, s, Dh, k_cache, (slot * KV + kh) * Dh, bf16);
  memcpy((char *)v_cache + ((slot * KV + kh) * Dh) * esz, (const char *)qkv + (t * row + (H + KV + kh) * Dh) * esz,
         (size_t)(Dh * esz));
}

int rope_kv(const void *qkv, const void *cs, const void *sn, const void *q_norm, const void *k_norm, float eps,
            int64_t T, int64_t H, int64_t KV, int64_t Dh, void *q_out, void *k_cache, void *v_cache,
            const int64_t *slots, int64_t num_slots, int bf16, int num_threads) {
  if (T < 1 || H < 1 || KV < 1 || H % KV || Dh < 2 || Dh > MAX_HEAD_DIM || Dh % 2) return -1;
  for (int64_t t = 0; t < T; t++)
    if (slots[t] < 0 || slots[t] >= num_slots) return -1; /* checked before anything is written */
  float qn[MAX_HEAD_DIM], kn[MAX_HEAD_DIM];
  if (q_norm != NULL) {
    load_row(q_norm, 0, Dh, bf16, qn);
    load_row(k_norm, 0, Dh, bf16, kn);
  }
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && T > 4)
  for (int64_t t = 0; t < T; t++) {
    float c[MAX_HEAD_DIM], s[MAX_HEAD_DIM];
    load_row(cs, t * Dh, Dh, bf16, c);
    load_row(sn, t * Dh, Dh, bf16, s);
    for (int64_t kh = 0; kh < KV; kh++)
      rope_kv_pair(qkv, c, s, q_norm != NULL ? qn : NULL, k_norm != NULL ? kn : NULL, eps, t, kh, H, KV, Dh, q_out,
                   k_cache, v_cache, slots[t], bf16);
  }
  return 0;
}
