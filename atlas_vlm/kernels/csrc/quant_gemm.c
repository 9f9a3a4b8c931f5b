/* Weight-only int4 / int8 matmul for CPU decode, for atlas_vlm/kernels/quant_kernel.py.
 *
 * out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]), the weight stored quantized in tiles of 16
 * output rows, the activation rows quantized on the fly to int8 in blocks of 32 (llama.cpp's
 * Q8 activations), every 32-wide block's dot product an exact int32 sum.
 *
 * Weights (row-major, contiguous; T = ceil(N / 16) tiles, G = K / group_size groups):
 *   int4  w [T][K / 8][16][4] uint8: byte (t, c, r, j) = q[16t + r][8c + j] | q[16t + r][8c + 4 + j] << 4,
 *         q in 0..15, W = q * scale + min
 *   int8  w [T][K / 4][16][4] int8:  byte (t, c, r, j) = q[16t + r][4c + j], W = q * scale (+ min)
 *   scale, min [T][G][16] fp32 or fp16 (scale_f16); min NULL for an int8 weight without mins
 * Activations: x [M, K] fp32 or bf16; per row and block b of 32: d = amax / 127,
 *   xq = nearbyint(x / d) as x * (1 / d) in fp32 (0 when d == 0), d = NaN where the block
 *   holds a NaN or an infinity (so the output row is NaN, never a silent wrong number).
 * Per output element, in this order (fp32, each step one fused multiply-add):
 *   for g: t = 0; for u in g: t = fma(d_b, isum_u, t);  acc = fma(scale_g, t, acc);
 *          (units u: the blocks of 32 in g, or g itself for a group of 16; b: u's block)
 *          with mins: acc = fma(min_g, X_g, acc)  with X_g = fold fma(d_b, sum_b(xq), .) over b in g
 *   out = acc (+ bias), rounded once to bf16 when the output is bf16 (nearest even).
 * The int32 sums are exact and every variant below does the float steps in the same order
 * per output element, so all variants (AVX512-VNNI, AVX2 with or without AVX-VNNI, plain C)
 * give the same bits; tests compare them.
 *
 * Variants by the compiler's target: __AVX512VNNI__ + __AVX512BW__ (16 rows a vector),
 * __AVX2__ (8 rows a vector; __AVXVNNI__ for dpbusd), else plain C.
 * Returns 0, or -1 for sizes out of range (K % 32, group_size neither 16 nor a multiple of 32, a
 * group that does not divide K, M or N < 1) or a failed allocation: nothing is written then.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define QK_AVX512 1
#include <immintrin.h>
#define MT 4
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QK_AVX2 1
#include <immintrin.h>
#define MT 2
#else
#define MT 1
#endif

#define TILE 16
#define QBLOCK 32

const char *quant_gemm_isa(void) {
#if defined(QK_AVX512)
  return "avx512vnni";
#elif defined(QK_AVX2) && defined(__AVXVNNI__)
  return "avx2+avxvnni";
#elif defined(QK_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

#include "quant_rows.c" /* f16_to_f32, load_scale, quantize_rows, store_tile */

/* ---- one tile of 16 output rows against activation rows m0 .. m0 + mt - 1 ------------------- */

typedef struct {
  const void *w, *scale, *min;
  int scale_f16, int4;
  int64_t K, gs;
  const int8_t *xq;
  const float *d, *xg;
  const int32_t *xs;
} Args;

#if defined(QK_AVX512)

static inline __m512 scale_vec(const void *p, int64_t i, int f16) {
  return f16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)))
             : _mm512_loadu_ps((const float *)p + i);
}

static inline __attribute__((always_inline)) void tile(const Args *a, int64_t t, int64_t m0, const int mt,
                                                       float out[MT][TILE]) {
  const int64_t K = a->K, nb = K / QBLOCK, G = K / a->gs, U = unit_of(a->gs), nu = K / U, upg = a->gs / U;
  const __m512i low = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x80);
  __m512 acc[MT];
  for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; g++) {
    __m512 tg[MT];
    for (int i = 0; i < mt; i++) tg[i] = _mm512_setzero_ps();
    for (int64_t u = g * upg; u < (g + 1) * upg; u++) {
      const int64_t b = u * U / QBLOCK, off = u * U % QBLOCK; /* values off .. off + U - 1 of block b */
      __m512i is[MT], is2[MT]; /* two chains: dpbusd's latency, not its throughput, bounds one */
      for (int i = 0; i < mt; i++) is[i] = is2[i] = _mm512_setzero_si512();
      if (a->int4) {
        const uint8_t *wb = (const uint8_t *)a->w + (t * (K / 8) + b * 4) * 64;
        for (int64_t c = off / 8; c < (off + U) / 8; c++) {
          const __m512i v = _mm512_loadu_si512((const void *)(wb + c * 64));
          const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
          for (int i = 0; i < mt; i++) {
            const int8_t *xp = a->xq + (m0 + i) * K + b * QBLOCK + c * 8;
            is[i] = _mm512_dpbusd_epi32(is[i], lo, _mm512_set1_epi32(load_i32(xp)));
            is2[i] = _mm512_dpbusd_epi32(is2[i], hi, _mm512_set1_epi32(load_i32(xp + 4)));
          }
        }
      } else { /* (q + 128) as u8 times x, less 128 * sum(x): exact */
        const int8_t *wb = (const int8_t *)a->w + (t * (K / 4) + b * 8) * 64;
        for (int64_t c = off / 4; c < (off + U) / 4; c++) {
          const __m512i v = _mm512_xor_si512(_mm512_loadu_si512((const void *)(wb + c * 64)), flip);
          for (int i = 0; i < mt; i++) {
            const __m512i xv = _mm512_set1_epi32(load_i32(a->xq + (m0 + i) * K + b * QBLOCK + c * 4));
            if (c & 1)
              is2[i] = _mm512_dpbusd_epi32(is2[i], v, xv);
            else
              is[i] = _mm512_dpbusd_epi32(is[i], v, xv);
          }
        }
        for (int i = 0; i < mt; i++) is[i] = _mm512_sub_epi32(is[i], _mm512_set1_epi32(128 * a->xs[(m0 + i) * nu + u]));
      }
      for (int i = 0; i < mt; i++) is[i] = _mm512_add_epi32(is[i], is2[i]);
      for (int i = 0; i < mt; i++)
        tg[i] = _mm512_fmadd_ps(_mm512_set1_ps(a->d[(m0 + i) * nb + b]), _mm512_cvtepi32_ps(is[i]), tg[i]);
    }
    const __m512 s = scale_vec(a->scale, (t * G + g) * TILE, a->scale_f16);
    for (int i = 0; i < mt; i++) acc[i] = _mm512_fmadd_ps(s, tg[i], acc[i]);
    if (a->min != NULL) {
      const __m512 mn = scale_vec(a->min, (t * G + g) * TILE, a->scale_f16);
      for (int i = 0; i < mt; i++) acc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a->xg[(m0 + i) * G + g]), acc[i]);
    }
  }
  for (int i = 0; i < mt; i++) _mm512_storeu_ps(out[i], acc[i]);
}

#elif defined(QK_AVX2)

static inline __m256 scale_vec(const void *p, int64_t i, int f16) {
  return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)))
             : _mm256_loadu_ps((const float *)p + i);
}

static inline __m256i dot4(__m256i acc, __m256i u, __m256i s) { /* acc += sum of 4 u8 * s8 per int32 lane */
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* 16 rows as two halves of 8 lanes; per lane the same float steps as the other variants. */
static inline __attribute__((always_inline)) void tile(const Args *a, int64_t t, int64_t m0, const int mt,
                                                       float out[MT][TILE]) {
  const int64_t K = a->K, nb = K / QBLOCK, G = K / a->gs, U = unit_of(a->gs), nu = K / U, upg = a->gs / U;
  const __m256i low = _mm256_set1_epi8(0x0f);
  for (int h = 0; h < 2; h++) {
    __m256 acc[MT];
    for (int i = 0; i < mt; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
      __m256 tg[MT];
      for (int i = 0; i < mt; i++) tg[i] = _mm256_setzero_ps();
      for (int64_t u = g * upg; u < (g + 1) * upg; u++) {
        const int64_t b = u * U / QBLOCK, off = u * U % QBLOCK;
        __m256i is[MT];
        for (int i = 0; i < mt; i++) is[i] = _mm256_setzero_si256();
        if (a->int4) {
          const uint8_t *wb = (const uint8_t *)a->w + (t * (K / 8) + b * 4) * 64 + h * 32;
          for (int64_t c = off / 8; c < (off + U) / 8; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(wb + c * 64));
            const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            for (int i = 0; i < mt; i++) {
              const int8_t *xp = a->xq + (m0 + i) * K + b * QBLOCK + c * 8;
              is[i] = dot4(is[i], lo, _mm256_set1_epi32(load_i32(xp)));
              is[i] = dot4(is[i], hi, _mm256_set1_epi32(load_i32(xp + 4)));
            }
          }
        } else { /* |q| times x with q's sign: no int16 saturation (2 * 128 * 127 < 32768) */
          const int8_t *wb = (const int8_t *)a->w + (t * (K / 4) + b * 8) * 64 + h * 32;
          for (int64_t c = off / 4; c < (off + U) / 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(wb + c * 64));
            const __m256i av = _mm256_sign_epi8(v, v);
            for (int i = 0; i < mt; i++) {
              const __m256i xv = _mm256_set1_epi32(load_i32(a->xq + (m0 + i) * K + b * QBLOCK + c * 4));
              is[i] = dot4(is[i], av, _mm256_sign_epi8(xv, v));
            }
          }
        }
        for (int i = 0; i < mt; i++)
          tg[i] = _mm256_fmadd_ps(_mm256_set1_ps(a->d[(m0 + i) * nb + b]), _mm256_cvtepi32_ps(is[i]), tg[i]);
      }
      const __m256 s = scale_vec(a->scale, (t * G + g) * TILE + h * 8, a->scale_f16);
      for (int i = 0; i < mt; i++) acc[i] = _mm256_fmadd_ps(s, tg[i], acc[i]);
      if (a->min != NULL) {
        const __m256 mn = scale_vec(a->min, (t * G + g) * TILE + h * 8, a->scale_f16);
        for (int i = 0; i < mt; i++) acc[i] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a->xg[(m0 + i) * G + g]), acc[i]);
      }
    }
    for (int i = 0; i < mt; i++) _mm256_storeu_ps(out[i] + h * 8, acc[i]);
  }
}

#else /* plain C */

static inline void tile(const Args *a, int64_t t, int64_t m0, const int mt, float out[MT][TILE]) {
  const int64_t K = a->K, nb = K / QBLOCK, G = K / a->gs, U = unit_of(a->gs), nu = K / U, upg = a->gs / U;
  (void)mt;
  for (int r = 0; r < TILE; r++) {
    float acc = 0.0f;
    for (int64_t g = 0; g < G; g++) {
      float tg = 0.0f;
      for (int64_t u = g * upg; u < (g + 1) * upg; u++) {
        const int64_t b = u * U / QBLOCK, off = u * U % QBLOCK;
        const int8_t *xp = a->xq + m0 * K + b * QBLOCK;
        int32_t is = 0;
        if (a->int4) {
          const uint8_t *wb = (const uint8_t *)a->w + (t * (K / 8) + b * 4) * 64 + r * 4;
          for (int64_t c = off / 8; c < (off + U) / 8; c++)
            for (int j = 0; j < 4; j++) {
              const uint8_t byte = wb[c * 64 + j];
              is += (int32_t)(byte & 15) * xp[c * 8 + j] + (int32_t)(byte >> 4) * xp[c * 8 + 4 + j];
            }
        } else {
          const int8_t *wb = (const int8_t *)a->w + (t * (K / 4) + b * 8) * 64 + r * 4;
          for (int64_t c = off / 4; c < (off + U) / 4; c++)
            for (int j = 0; j < 4; j++) is += (int32_t)wb[c * 64 + j] * xp[c * 4 + j];
        }
        tg = fmaf(a->d[m0 * nb + b], (float)is, tg);
      }
      acc = fmaf(load_scale(a->scale, (t * G + g) * TILE + r, a->scale_f16), tg, acc);
      if (a->min != NULL) acc = fmaf(load_scale(a->min, (t * G + g) * TILE + r, a->scale_f16), a->xg[m0 * G + g], acc);
    }
    out[0][r] = acc;
  }
}

#endif

/* Tile t against every activation row: MT rows at a time, then one at a time. */
static void tile_rows(const Args *a, int64_t t, int64_t M, int64_t N, const float *bias, void *out, int out_bf16) {
  float acc[MT][TILE];
  int64_t m = 0;
  for (; m + MT <= M; m += MT) {
    tile(a, t, m, MT, acc);
    for (int i = 0; i < MT; i++) store_tile(out, out_bf16, N, m + i, t * TILE, acc[i], bias);
  }
  for (; m < M; m++) {
    tile(a, t, m, 1, acc);
    store_tile(out, out_bf16, N, m, t * TILE, acc[0], bias);
  }
}

static int quant_gemm(const void *x, int x_bf16, int64_t M, int64_t K, const void *w, const void *scale,
                      const void *min, int scale_f16, int64_t N, int64_t gs, const float *bias, void *out,
                      int out_bf16, int num_threads, int int4) {
  if (M < 1 || N < 1 || K < QBLOCK || K % QBLOCK || (gs != 16 && (gs < QBLOCK || gs % QBLOCK)) || K % gs) return -1;
  const int64_t nb = K / QBLOCK, G = K / gs, T = (N + TILE - 1) / TILE;
  int8_t *xq = (int8_t *)malloc((size_t)(M * K));
  float *d = (float *)malloc(sizeof(float) * (size_t)(M * nb)), *xg = NULL;
  int32_t *xs = (int32_t *)malloc(sizeof(int32_t) * (size_t)(M * (K / unit_of(gs))));
  if (min != NULL) xg = (float *)malloc(sizeof(float) * (size_t)(M * G));
  if (xq == NULL || d == NULL || xs == NULL || (min != NULL && xg == NULL)) {
    free(xq), free(d), free(xs), free(xg);
    return -1;
  }
  quantize_rows(x, x_bf16, M, K, gs, xq, d, xs, xg);
  const Args a = {w, scale, min, scale_f16, int4, K, gs, xq, d, xg, xs};
  if (num_threads > 1 && T > 1) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < T; t++) tile_rows(&a, t, M, N, bias, out, out_bf16);
  } else { /* no parallel region at all for one thread */
    for (int64_t t = 0; t < T; t++) tile_rows(&a, t, M, N, bias, out, out_bf16);
  }
  free(xq), free(d), free(xs), free(xg);
  return 0;
}

int quant_gemm_int4(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, const void *scale,
                    const void *min, int scale_f16, int64_t N, int64_t gs, const float *bias, void *out,
                    int out_bf16, int num_threads) {
  return quant_gemm(x, x_bf16, M, K, w, scale, min, scale_f16, N, gs, bias, out, out_bf16, num_threads, 1);
}

int quant_gemm_int8(const void *x, int x_bf16, int64_t M, int64_t K, const int8_t *w, const void *scale,
                    const void *min, int scale_f16, int64_t N, int64_t gs, const float *bias, void *out,
                    int out_bf16, int num_threads) {
  return quant_gemm(x, x_bf16, M, K, w, scale, min, scale_f16, N, gs, bias, out, out_bf16, num_threads, 0);
}

#include "quant_dequantize.c" /* quant_dequantize: the tiles as a dense weight */
