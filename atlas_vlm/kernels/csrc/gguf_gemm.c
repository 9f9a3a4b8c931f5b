/* y[m, n] = sum_k x[m, k] * W[n, k] with W a GGUF tensor as stored in the file: N rows of ggml
 * blocks (block_q4_K 144 bytes, block_q5_K 176, block_q6_K 210 per 256 values; block_q8_0 34
 * per 32; ggml-common.h), read in place; for atlas_vlm/kernels/gguf_kernel.py.
 *
 * The activations are quantized once per call to q8_K: per row and 256 values d = amax / 127
 * (fp32), q = nearbyint(x * (1 / d)) (0 when d == 0; d = NaN where the 256 hold a NaN or an
 * infinity, so the output row is NaN), and bsums, the int16 sums of q per 16. Per output, per
 * super-block of 256, the integer dot products are exact: sub-block scales applied in int32,
 * Q4_K / Q5_K mins and Q6_K's -32 through the bsums (never per element), then
 *   acc += (d_x * d_w) * sumi  (- (d_x * dmin) * summ)      in fp32
 * (Q8_0: each block of 32 its fp16 scale: acc += d_x * sum_b d_b * isum_b). The variants differ
 * only in the fp32 summation order: AVX512-VNNI (gguf_gemm_avx512.h), AVX2
 * (gguf_gemm_avx2.h), plain C (below), by the compiler's target.
 * Up to MAX_ROWS activation rows share one unpacking of each weight super-block; OpenMP over
 * output rows n. Returns 0, or -1 (nothing written) for a type it does not know, K not a
 * multiple of 256, M or N < 1, or a failed allocation.
 *
 * The fast path: gguf_repack interleaves Q4_K / Q6_K / Q8_0 rows 16 at a time (gguf_repack.h,
 * once, at load) and gguf_gemm_packed runs the same q8_K activations on them
 * (gguf_r16_avx512.h, gguf_r16_avx2.h, r16_plain: the same bits in every variant); its
 * r16_range is what the one-call decode step (decode_step.c) calls per thread. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define QK_K 256
#define MAX_ROWS 8
enum { GGML_Q8_0 = 8, GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14 }; /* ggml_type ids */

typedef struct { /* the activations as q8_K: qs [M][K], d [M][nb], bsums [M][nb][16] */
  const int8_t *qs;
  const float *d;
  const int16_t *bsums;
  int64_t K, nb;
  const int16_t *bs32; /* [M][nb][8] sums per 32 (the r16 Q4_K kernels' mins) */
  const int32_t *b6;   /* [M][nb][16] -32 * bsums (the r16 Q6_K kernels' offset) */
} Q8K;

#include "half.h"
#include "bf16.h"
#if defined(__F16C__)
#include <immintrin.h>
#endif

static inline float f16_at(const uint8_t *p) { /* the little-endian fp16 at p, exact */
#if defined(__F16C__)
  uint16_t h;
  memcpy(&h, p, 2);
  return _cvtsh_ss(h);
#else
  return f16_to_f32((uint16_t)(p[0] | p[1] << 8));
#endif
}

/* Q4_K / Q5_K's 12 scale bytes -> bytes of u: 8 six-bit scales, then 8 six-bit mins (ggml's masks). */
static inline void unpack_k4_scales(const uint8_t *s, uint32_t u[4]) {
  uint32_t a[3];
  memcpy(a, s, 12);
  u[0] = a[0] & 0x3f3f3f3fu;
  u[1] = (a[2] & 0x0f0f0f0fu) | (((a[0] >> 6) & 0x03030303u) << 4);
  u[2] = a[1] & 0x3f3f3f3fu;
  u[3] = ((a[2] >> 4) & 0x0f0f0f0fu) | (((a[1] >> 6) & 0x03030303u) << 4);
}

#include "gguf_repack.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define GG_ISA "avx512vnni"
#include "gguf_gemm_avx512.h"
#include "gguf_r16_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GG_ISA "avx2"
#include "gguf_gemm_avx2.h"
#include "gguf_r16_avx2.h"
#else
#define GG_ISA "scalar"
#define GG_PLAIN 1
static void rows_plain(const uint8_t *row, int type, int64_t bb, const Q8K *q, int64_t m0, int mt, float *res) {
  int32_t w[QK_K], sc[16], mn[8];
  float dw[8];
  for (int i = 0; i < mt; i++) res[i] = 0.0f;
  for (int64_t ib = 0; ib < q->nb; ib++) {
    unpack_super(row + ib * bb, type, w, sc, mn, dw);
    for (int i = 0; i < mt; i++) {
      const int8_t *x = q->qs + (m0 + i) * q->K + ib * QK_K;
      const int16_t *bs = q->bsums + ((m0 + i) * q->nb + ib) * 16;
      const float dx = q->d[(m0 + i) * q->nb + ib];
      const int len = type == GGML_Q6_K ? 16 : 32; /* values per scale */
      int32_t sumi = 0, summ = 0;
      float t = 0.0f;
      for (int j = 0; j < QK_K / len; j++) {
        int32_t is = 0;
        for (int l = 0; l < len; l++) is += w[len * j + l] * x[len * j + l];
        if (type == GGML_Q8_0) t = fmaf(dw[j], (float)is, t);
        else if (type == GGML_Q6_K) sumi += sc[j] * (is - 32 * bs[j]);
        else sumi += sc[j] * is, summ += mn[j] * (bs[2 * j] + bs[2 * j + 1]);
      }
      if (type == GGML_Q8_0) res[i] = fmaf(dx, t, res[i]);
      else res[i] = fmaf(-dx * dw[1], (float)summ, fmaf(dx * dw[0], (float)sumi, res[i]));
    }
  }
}
#endif

const char *gguf_gemm_isa(void) { return GG_ISA; }

static int64_t block_bytes(int type) { /* bytes per 256 values */
  return type == GGML_Q4_K ? 144 : type == GGML_Q5_K ? 176 : type == GGML_Q6_K ? 210 : type == GGML_Q8_0 ? 272 : 0;
}

/* one weight row against activation rows m0 .. m0 + mt - 1 (mt <= MAX_ROWS): res[i] */
static void row_dot(const uint8_t *row, int type, const Q8K *q, int64_t m0, int mt, float *res) {
#if defined(GG_PLAIN)
  rows_plain(row, type, block_bytes(type), q, m0, mt, res);
#else
#define GG_CASES(call)                                                                                          \
  switch (mt) {                                                                                                 \
    case 1: call(1); break; case 2: call(2); break; case 3: call(3); break; case 4: call(4); break;             \
    case 5: call(5); break; case 6: call(6); break; case 7: call(7); break; default: call(8); break;            \
  }
#define K4(n) k4_rows(row, q, m0, n, res, 0)
#define K5(n) k4_rows(row, q, m0, n, res, 1)
#define K6(n) q6_rows(row, q, m0, n, res)
#define K8(n) q8_0_rows(row, q, m0, n, res)
  if (type == GGML_Q4_K) GG_CASES(K4) else if (type == GGML_Q5_K) GG_CASES(K5)
  else if (type == GGML_Q6_K) GG_CASES(K6) else GG_CASES(K8)
#endif
}

/* x [M][K] fp32 -> q8_K (see the top of this file), with the r16 kernels' bs32 and b6 */
static void quantize_q8_K(const float *x, int64_t M, int64_t K, Q8K *out) {
  const int64_t nb = K / QK_K;
  int8_t *qs = (int8_t *)out->qs;
  float *d = (float *)out->d;
  int16_t *bsums = (int16_t *)out->bsums, *bs32 = (int16_t *)out->bs32;
  int32_t *b6 = (int32_t *)out->b6;
  for (int64_t r = 0; r < M * nb; r++) {
    const float *v = x + r * QK_K;
    float amax = 0.0f;
    int bad = 0;
    for (int i = 0; i < QK_K; i++) {
      const float a = fabsf(v[i]);
      bad |= !(a <= 3.402823466e38f); /* NaN or infinity */
      amax = a > amax ? a : amax;
    }
    const float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
    int8_t *q = qs + r * QK_K;
    for (int i = 0; i < QK_K; i++) q[i] = bad ? 0 : (int8_t)nearbyintf(v[i] * id);
    for (int j = 0; j < 16; j++) {
      int s = 0;
      for (int i = 0; i < 16; i++) s += q[16 * j + i];
      bsums[r * 16 + j] = (int16_t)s, b6[r * 16 + j] = -32 * s;
    }
    for (int j = 0; j < 8; j++) bs32[r * 8 + j] = (int16_t)(bsums[r * 16 + 2 * j] + bsums[r * 16 + 2 * j + 1]);
    d[r] = bad ? NAN : db;
  }
}

/* scratch for M rows of q8_K (one allocation, freed with free(q->qs)); 0 or -1 */
static int q8k_alloc(int64_t M, int64_t K, Q8K *q) {
  const int64_t nb = K / QK_K, n = M * nb;
  char *p = (char *)malloc((size_t)(M * K + n * (4 + 32 + 16 + 64)));
  if (p == NULL) return -1;
  q->qs = (int8_t *)p, q->d = (float *)(p + M * K), q->b6 = (int32_t *)(p + M * K + 4 * n);
  q->bsums = (int16_t *)(p + M * K + 68 * n), q->bs32 = (int16_t *)(p + M * K + 100 * n);
  q->K = K, q->nb = nb;
  return 0;
}

int gguf_gemm(const float *x, int64_t M, int64_t K, const uint8_t *w, int type, int64_t N, float *out,
              int num_threads) {
  const int64_t bb = block_bytes(type), nb = K / QK_K, row_bytes = nb * bb;
  Q8K q;
  if (bb == 0 || M < 1 || N < 1 || K < QK_K || K % QK_K || q8k_alloc(M, K, &q)) return -1;
  quantize_q8_K(x, M, K, &q);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && N > 1)
  for (int64_t n = 0; n < N; n++) {
    float res[MAX_ROWS];
    for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
      const int mt = M - m0 < MAX_ROWS ? (int)(M - m0) : MAX_ROWS;
      row_dot(w + n * row_bytes, type, &q, m0, mt, res);
      for (int i = 0; i < mt; i++) out[(m0 + i) * N + n] = res[i];
    }
  }
  free((void *)q.qs);
  return 0;
}

#include "gguf_r16.h"
