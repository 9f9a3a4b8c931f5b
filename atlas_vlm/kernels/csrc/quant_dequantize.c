/* The tiles of atlas_vlm/kernels/csrc/quant_gemm.c dequantized to a dense weight (quant_dequantize),
 * for kernels/quant_kernel.py's dequantize. Included by quant_gemm.c (its layout, helpers and
 * ISA macros), not built on its own. */

/* One row of the dense weight, fp32, into row[K]. */
#if defined(QK_AVX512) || defined(QK_AVX2)
static inline void store16(float *dst, __m128i bytes16, int is_signed, __m256 sc, __m256 mn, int add_min) {
  /* 16 values (bytes) -> float, times the scale, plus the min: a multiply then an add */
  for (int h = 0; h < 2; h++) {
    const __m128i b = h ? _mm_srli_si128(bytes16, 8) : bytes16;
    const __m256i iv = is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
    __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(iv), sc);
    if (add_min) v = _mm256_add_ps(v, mn);
    _mm256_storeu_ps(dst + 8 * h, v);
  }
}
#endif

static void dequantize_row(const void *w, const void *scale, const void *min, int scale_f16, int64_t K, int64_t gs,
                           int int4, int64_t t, int64_t r, float *row) {
  const int64_t G = K / gs, per_chunk = int4 ? 8 : 4;
  const uint8_t *wb = (const uint8_t *)w + t * (K / per_chunk) * TILE * 4 + r * 4; /* 4 bytes a chunk, stride 64 */
  for (int64_t g = 0; g < G; g++) {
    const float sc = load_scale(scale, (t * G + g) * TILE + r, scale_f16);
    const float mn = min != NULL ? load_scale(min, (t * G + g) * TILE + r, scale_f16) : 0.0f;
    int64_t k = g * gs;
#if defined(QK_AVX512) || defined(QK_AVX2)
    const __m256 vs = _mm256_set1_ps(sc), vm = _mm256_set1_ps(mn);
    const __m128i low = _mm_set1_epi8(0x0f);
    for (; k + 16 <= (g + 1) * gs; k += 16) {
      int32_t a, b;
      if (int4) { /* chunks k/8 and k/8 + 1: [lo | hi] of each, 16 values in order */
        memcpy(&a, wb + (k / 8) * 64, 4);
        memcpy(&b, wb + (k / 8 + 1) * 64, 4);
        const __m128i x = _mm_set_epi32(0, 0, b, a);
        const __m128i lo = _mm_and_si128(x, low), hi = _mm_and_si128(_mm_srli_epi16(x, 4), low);
        store16(row + k, _mm_unpacklo_epi32(lo, hi), 0, vs, vm, min != NULL);
      } else { /* chunks k/4 .. k/4 + 3 */
        int32_t c, d;
        memcpy(&a, wb + (k / 4) * 64, 4);
        memcpy(&b, wb + (k / 4 + 1) * 64, 4);
        memcpy(&c, wb + (k / 4 + 2) * 64, 4);
        memcpy(&d, wb + (k / 4 + 3) * 64, 4);
        store16(row + k, _mm_set_epi32(d, c, b, a), 1, vs, vm, min != NULL);
      }
    }
#endif
    for (; k < (g + 1) * gs; k++) {
      float q;
      if (int4) {
        const uint8_t byte = wb[(k / 8) * 64 + (k % 4)];
        q = (float)((k % 8) < 4 ? (byte & 15) : (byte >> 4));
      } else {
        q = (float)((const int8_t *)wb)[(k / 4) * 64 + (k % 4)];
      }
      const float p = q * sc;
      row[k] = min != NULL ? p + mn : p;
    }
  }
}

/* Dense W [N][K] (fp32 or bf16) from the tiles (int4: the nibble layout; min NULL: no min):
 * q * scale + min, a multiply then an add (no
 * fused step: the same bits as the PyTorch reference's dequantize), rounded once to bf16. */
int quant_dequantize(const void *w, const void *scale, const void *min, int scale_f16, int64_t N, int64_t K,
                     int64_t gs, int int4, void *out, int out_bf16, int num_threads) {
  if (N < 1 || K < QBLOCK || K % QBLOCK || (gs != 16 && (gs < QBLOCK || gs % QBLOCK)) || K % gs) return -1;
  int status = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    float *row = out_bf16 ? (float *)malloc(sizeof(float) * (size_t)K) : NULL;
    if (out_bf16 && row == NULL) {
#pragma omp atomic write
      status = -1;
    }
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) {
      if (out_bf16 && row == NULL) continue;
      float *dst = out_bf16 ? row : (float *)out + n * K;
      dequantize_row(w, scale, min, scale_f16, K, gs, int4, n / TILE, n % TILE, dst);
      if (out_bf16) {
        uint16_t *o = (uint16_t *)out + n * K;
        for (int64_t k = 0; k < K; k++) o[k] = f32_to_bf16(row[k]);
      }
    }
    free(row);
  }
  return status;
}
