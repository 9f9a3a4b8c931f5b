/* AVX2 kernels on 16 interleaved rows (layout: gguf_repack.h), included by gguf_gemm.c: each
 * 64-byte group as two 32-byte halves of 8 rows; vpmaddubsw (u8 quants times int8 values, int16
 * sums of 2, no saturation: 2 * 63 * 128 < 2^15), then vpmaddwd with the scales as int16 pairs
 * (Q4_K: 4 vpmaddubsw summed in int16, |.| <= 8 * 15 * 128) or with ones and a vpmulld (Q6_K,
 * 2 summed). The same int32s as the other variants, the same fp32 order. */
#include <immintrin.h>

static inline int32_t ld32(const int8_t *p) {
  int32_t v;
  memcpy(&v, p, 4);
  return v;
}

static inline __m256i ubs(__m256i w, const int8_t *x) { return _mm256_maddubs_epi16(w, _mm256_set1_epi32(ld32(x))); }

static inline __attribute__((always_inline)) void q4k_r16(const uint8_t *g, const Q8K *q, int64_t m0, const int mt,
                                                          float *res) {
  const __m256i mf = _mm256_set1_epi8(0x0f);
  for (int h = 0; h < 2; h++) {
    __m256 acc[MAX_ROWS];
    for (int i = 0; i < mt; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t ib = 0; ib < q->nb; ib++) {
      const uint8_t *b = g + ib * 2368;
      __m256i isum[MAX_ROWS];
      for (int i = 0; i < mt; i++) isum[i] = _mm256_setzero_si256();
      for (int j = 0; j < 8; j++) {
        const __m256i s32 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 64 + 16 * j + 8 * h)));
        const __m256i sc = _mm256_or_si256(s32, _mm256_slli_epi32(s32, 16)); /* [s, s] int16 pairs */
        __m256i w[8];
        for (int t = 0; t < 4; t++) {
          const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 320 + 256 * j + 64 * t + 32 * h));
          w[t] = _mm256_and_si256(v, mf);
          w[4 + t] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mf);
        }
        for (int i = 0; i < mt; i++) {
          const int8_t *x = q->qs + (m0 + i) * q->K + ib * QK_K + 32 * j;
          const __m256i sa = _mm256_add_epi16(_mm256_add_epi16(ubs(w[0], x), ubs(w[1], x + 4)),
                                              _mm256_add_epi16(ubs(w[2], x + 8), ubs(w[3], x + 12)));
          const __m256i sb = _mm256_add_epi16(_mm256_add_epi16(ubs(w[4], x + 16), ubs(w[5], x + 20)),
                                              _mm256_add_epi16(ubs(w[6], x + 24), ubs(w[7], x + 28)));
          isum[i] = _mm256_add_epi32(isum[i], _mm256_add_epi32(_mm256_madd_epi16(sa, sc), _mm256_madd_epi16(sb, sc)));
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 16 * h)));
      const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 32 + 16 * h)));
      __m256i mn[4];
      for (int t = 0; t < 4; t++) mn[t] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + 192 + 32 * t + 16 * h)));
      for (int i = 0; i < mt; i++) {
        const int64_t qi = (m0 + i) * q->nb + ib;
        const float dx = q->d[qi];
        const int8_t *p = (const int8_t *)(q->bs32 + qi * 8);
        __m256i s = _mm256_setzero_si256();
        for (int t = 0; t < 4; t++) s = _mm256_add_epi32(s, _mm256_madd_epi16(mn[t], _mm256_set1_epi32(ld32(p + 4 * t))));
        acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(dx)), _mm256_cvtepi32_ps(isum[i]), acc[i]);
        acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(dm, _mm256_set1_ps(-dx)), _mm256_cvtepi32_ps(s), acc[i]);
      }
    }
    for (int i = 0; i < mt; i++) _mm256_storeu_ps(res + R16 * i + 8 * h, acc[i]);
  }
}

static inline __m256i q6_hi(__m256i h, int t) { /* bits 2t, 2t + 1 of each byte moved to 4-5 */
  const __m256i m30 = _mm256_set1_epi8(0x30);
  return _mm256_and_si256(t == 0 ? _mm256_slli_epi16(h, 4) : t == 1 ? _mm256_slli_epi16(h, 2)
                          : t == 2 ? h : _mm256_srli_epi16(h, 2), m30);
}

static inline __attribute__((always_inline)) void q6k_r16(const uint8_t *g, const Q8K *q, int64_t m0, const int mt,
                                                          float *res) {
  const __m256i mf = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; h++) {
    __m256 acc[MAX_ROWS];
    for (int i = 0; i < mt; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t ib = 0; ib < q->nb; ib++) {
      const uint8_t *b = g + ib * 3360;
      __m256i isum[MAX_ROWS];
      for (int i = 0; i < mt; i++) isum[i] = _mm256_setzero_si256();
      for (int c = 0; c < 8; c++) {
        const __m256i sca = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 32 + 32 * c + 8 * h)));
        const __m256i scb = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 48 + 32 * c + 8 * h)));
        const __m256i ha = _mm256_loadu_si256((const __m256i *)(b + 2336 + 128 * c + 32 * h));
        const __m256i hb = _mm256_loadu_si256((const __m256i *)(b + 2400 + 128 * c + 32 * h));
        __m256i w[8];
        for (int t = 0; t < 4; t++) {
          const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 288 + 256 * c + 64 * t + 32 * h));
          w[t] = _mm256_or_si256(_mm256_and_si256(v, mf), q6_hi(ha, t));
          w[4 + t] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), mf), q6_hi(hb, t));
        }
        for (int i = 0; i < mt; i++) {
          const int64_t qi = (m0 + i) * q->nb + ib;
          const int8_t *x = q->qs + (m0 + i) * q->K + ib * QK_K + 32 * c;
          __m256i sa = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(ubs(w[0], x), ubs(w[1], x + 4)), one),
                                        _mm256_madd_epi16(_mm256_add_epi16(ubs(w[2], x + 8), ubs(w[3], x + 12)), one));
          __m256i sb = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(ubs(w[4], x + 16), ubs(w[5], x + 20)), one),
                                        _mm256_madd_epi16(_mm256_add_epi16(ubs(w[6], x + 24), ubs(w[7], x + 28)), one));
          sa = _mm256_add_epi32(sa, _mm256_set1_epi32(q->b6[qi * 16 + 2 * c]));
          sb = _mm256_add_epi32(sb, _mm256_set1_epi32(q->b6[qi * 16 + 2 * c + 1]));
          isum[i] = _mm256_add_epi32(isum[i], _mm256_add_epi32(_mm256_mullo_epi32(sa, sca), _mm256_mullo_epi32(sb, scb)));
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 16 * h)));
      for (int i = 0; i < mt; i++) {
        const float dx = q->d[(m0 + i) * q->nb + ib];
        acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(dx)), _mm256_cvtepi32_ps(isum[i]), acc[i]);
      }
    }
    for (int i = 0; i < mt; i++) _mm256_storeu_ps(res + R16 * i + 8 * h, acc[i]);
  }
}

/* Q8_0: the signed quants back (u ^ 0x80), then vpmaddubsw(|w|, sign(x, w)) (|pair| <= 2 * 128 *
 * 127, no saturation) and vpmaddwd with ones: the exact dot per block of 32. */
static inline __attribute__((always_inline)) void q80_r16(const uint8_t *g, const Q8K *q, int64_t m0, const int mt,
                                                          float *res) {
  const __m256i flip = _mm256_set1_epi8((char)0x80), one = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; h++) {
    __m256 acc[MAX_ROWS];
    for (int i = 0; i < mt; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t ib = 0; ib < q->nb; ib++) {
      const uint8_t *b = g + ib * 4352;
      __m256 t8[MAX_ROWS];
      for (int i = 0; i < mt; i++) t8[i] = _mm256_setzero_ps();
      for (int j = 0; j < 8; j++) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 32 * j + 16 * h)));
        __m256i w[8], aw[8];
        for (int t = 0; t < 8; t++) {
          w[t] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 256 + 512 * j + 64 * t + 32 * h)), flip);
          aw[t] = _mm256_abs_epi8(w[t]);
        }
        for (int i = 0; i < mt; i++) {
          const int8_t *x = q->qs + (m0 + i) * q->K + ib * QK_K + 32 * j;
          __m256i s = _mm256_setzero_si256();
          for (int t = 0; t < 8; t += 2) {
            const __m256i p0 = _mm256_maddubs_epi16(aw[t], _mm256_sign_epi8(_mm256_set1_epi32(ld32(x + 4 * t)), w[t]));
            const __m256i p1 = _mm256_maddubs_epi16(aw[t + 1], _mm256_sign_epi8(_mm256_set1_epi32(ld32(x + 4 * t + 4)), w[t + 1]));
            s = _mm256_add_epi32(s, _mm256_add_epi32(_mm256_madd_epi16(p0, one), _mm256_madd_epi16(p1, one)));
          }
          t8[i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s), t8[i]);
        }
      }
      for (int i = 0; i < mt; i++)
        acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(q->d[(m0 + i) * q->nb + ib]), t8[i], acc[i]);
    }
    for (int i = 0; i < mt; i++) _mm256_storeu_ps(res + R16 * i + 8 * h, acc[i]);
  }
}
