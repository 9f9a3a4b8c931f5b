/* AVX512-VNNI kernels on 16 interleaved rows (layout: gguf_repack.h), included by gguf_gemm.c:
 * a 64-byte vector holds 4 values of each of the 16 rows, so one vpdpbusd against one
 * broadcast int32 of the activation (4 int8 values) adds 4 products to each row's lane; every
 * lane is an output row, so no horizontal sums. Q4_K: 4 vpdpbusd (|sum| <= 16 * 15 * 128 fits
 * int16) then vpdpwssd with the sub-block scales (low 16 bits of each lane, 0 above); the mins
 * by vpdpwssd of [min_2t, min_2t+1] pairs with the activation's 32-value sums. Q6_K: 4
 * vpdpbusd started at -32 * bsum (the offset for free), then vpmulld by the int8 scale. */
#include <immintrin.h>

static inline int32_t ld32(const int8_t *p) {
  int32_t v;
  memcpy(&v, p, 4);
  return v;
}

static inline __attribute__((always_inline)) void q4k_r16(const uint8_t *g, const Q8K *q, int64_t m0, const int mt,
                                                          float *res) {
  const __m512i mf = _mm512_set1_epi8(0x0f);
  __m512 acc[MAX_ROWS];
  for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
  for (int64_t ib = 0; ib < q->nb; ib++) {
    const uint8_t *b = g + ib * 2368;
    __m512i isum[MAX_ROWS];
    for (int i = 0; i < mt; i++) isum[i] = _mm512_setzero_si512();
    for (int j = 0; j < 8; j++) {
      const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 64 + 16 * j)));
      __m512i w[8];
      for (int t = 0; t < 4; t++) {
        const __m512i v = _mm512_loadu_si512((const void *)(b + 320 + 256 * j + 64 * t));
        w[t] = _mm512_and_si512(v, mf);
        w[4 + t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mf);
      }
      for (int i = 0; i < mt; i++) {
        const int8_t *x = q->qs + (m0 + i) * q->K + ib * QK_K + 32 * j;
        __m512i sa = _mm512_setzero_si512(), sb = _mm512_setzero_si512();
        for (int t = 0; t < 4; t++) {
          sa = _mm512_dpbusd_epi32(sa, w[t], _mm512_set1_epi32(ld32(x + 4 * t)));
          sb = _mm512_dpbusd_epi32(sb, w[4 + t], _mm512_set1_epi32(ld32(x + 16 + 4 * t)));
        }
        isum[i] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(isum[i], sa, sc), sb, sc);
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b));
    const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 32)));
    __m512i mn[4];
    for (int t = 0; t < 4; t++) mn[t] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 192 + 32 * t)));
    for (int i = 0; i < mt; i++) {
      const int64_t qi = (m0 + i) * q->nb + ib;
      const float dx = q->d[qi];
      const int8_t *p = (const int8_t *)(q->bs32 + qi * 8);
      __m512i s = _mm512_setzero_si512();
      for (int t = 0; t < 4; t++) s = _mm512_dpwssd_epi32(s, mn[t], _mm512_set1_epi32(ld32(p + 4 * t)));
      acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx)), _mm512_cvtepi32_ps(isum[i]), acc[i]);
      acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(dm, _mm512_set1_ps(-dx)), _mm512_cvtepi32_ps(s), acc[i]);
    }
  }
  for (int i = 0; i < mt; i++) _mm512_storeu_ps(res + R16 * i, acc[i]);
}

/* the top two bits at 2t of each byte of h, moved to bits 4-5 */
static inline __m512i q6_hi(__m512i h, int t) {
  const __m512i m30 = _mm512_set1_epi8(0x30);
  return _mm512_and_si512(t == 0 ? _mm512_slli_epi16(h, 4) : t == 1 ? _mm512_slli_epi16(h, 2)
                          : t == 2 ? h : _mm512_srli_epi16(h, 2), m30);
}

/* Q6_K's 64-byte weight vectors of super-block b, in the order q6k_r16 uses them: [c][8] */
static inline void q6_unpack(const uint8_t *b, __m512i *wv) {
  const __m512i mf = _mm512_set1_epi8(0x0f);
  for (int c = 0; c < 8; c++) {
    const __m512i ha = _mm512_loadu_si512((const void *)(b + 2336 + 128 * c));
    const __m512i hb = _mm512_loadu_si512((const void *)(b + 2400 + 128 * c));
    for (int t = 0; t < 4; t++) {
      const __m512i v = _mm512_loadu_si512((const void *)(b + 288 + 256 * c + 64 * t));
      wv[8 * c + t] = _mm512_or_si512(_mm512_and_si512(v, mf), q6_hi(ha, t));
      wv[8 * c + 4 + t] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), mf), q6_hi(hb, t));
    }
  }
}

/* pre: NULL, or the group's weight vectors already unpacked (q6_unpack per super-block, 4096
 * bytes each: many activation rows against one group read them instead of unpacking again) */
static inline __attribute__((always_inline)) void q6k_r16_w(const uint8_t *g, const __m512i *pre, const Q8K *q,
                                                            int64_t m0, const int mt, float *res) {
  __m512 acc[MAX_ROWS];
  for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
  for (int64_t ib = 0; ib < q->nb; ib++) {
    const uint8_t *b = g + ib * 3360;
    __m512i isum[MAX_ROWS];
    for (int i = 0; i < mt; i++) isum[i] = _mm512_setzero_si512();
    for (int c = 0; c < 8; c++) {
      const __m512i sca = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 32 + 32 * c)));
      const __m512i scb = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 48 + 32 * c)));
      __m512i w[8];
      if (pre != NULL) {
        for (int t = 0; t < 8; t++) w[t] = _mm512_load_si512((const void *)(pre + 64 * ib + 8 * c + t));
      } else {
        const __m512i mf = _mm512_set1_epi8(0x0f);
        const __m512i ha = _mm512_loadu_si512((const void *)(b + 2336 + 128 * c));
        const __m512i hb = _mm512_loadu_si512((const void *)(b + 2400 + 128 * c));
        for (int t = 0; t < 4; t++) {
          const __m512i v = _mm512_loadu_si512((const void *)(b + 288 + 256 * c + 64 * t));
          w[t] = _mm512_or_si512(_mm512_and_si512(v, mf), q6_hi(ha, t));
          w[4 + t] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), mf), q6_hi(hb, t));
        }
      }
      for (int i = 0; i < mt; i++) {
        const int64_t qi = (m0 + i) * q->nb + ib;
        const int8_t *x = q->qs + (m0 + i) * q->K + ib * QK_K + 32 * c;
        __m512i sa = _mm512_set1_epi32(q->b6[qi * 16 + 2 * c]), sb = _mm512_set1_epi32(q->b6[qi * 16 + 2 * c + 1]);
        for (int t = 0; t < 4; t++) {
          sa = _mm512_dpbusd_epi32(sa, w[t], _mm512_set1_epi32(ld32(x + 4 * t)));
          sb = _mm512_dpbusd_epi32(sb, w[4 + t], _mm512_set1_epi32(ld32(x + 16 + 4 * t)));
        }
        isum[i] = _mm512_add_epi32(isum[i], _mm512_add_epi32(_mm512_mullo_epi32(sa, sca), _mm512_mullo_epi32(sb, scb)));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b));
    for (int i = 0; i < mt; i++) {
      const float dx = q->d[(m0 + i) * q->nb + ib];
      acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx)), _mm512_cvtepi32_ps(isum[i]), acc[i]);
    }
  }
  for (int i = 0; i < mt; i++) _mm512_storeu_ps(res + R16 * i, acc[i]);
}
#define q6k_r16(g, q, m0, mt, res) q6k_r16_w(g, NULL, q, m0, mt, res)
#define GG_Q6_PRE 1 /* r16_range unpacks a Q6_K group once for 9+ activation rows */

/* Q8_0: the quants stored + 128 (unsigned), so vpdpbusd started at -128 * bsum32 is the exact
 * signed dot product of each block of 32; its fp16 scales per row and block in lanes. */
static inline __attribute__((always_inline)) void q80_r16(const uint8_t *g, const Q8K *q, int64_t m0, const int mt,
                                                          float *res) {
  __m512 acc[MAX_ROWS];
  for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
  for (int64_t ib = 0; ib < q->nb; ib++) {
    const uint8_t *b = g + ib * 4352;
    __m512 t8[MAX_ROWS];
    for (int i = 0; i < mt; i++) t8[i] = _mm512_setzero_ps();
    for (int j = 0; j < 8; j++) {
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 32 * j)));
      __m512i w[8];
      for (int t = 0; t < 8; t++) w[t] = _mm512_loadu_si512((const void *)(b + 256 + 512 * j + 64 * t));
      for (int i = 0; i < mt; i++) {
        const int64_t qi = (m0 + i) * q->nb + ib;
        const int8_t *x = q->qs + (m0 + i) * q->K + ib * QK_K + 32 * j;
        __m512i s = _mm512_set1_epi32(-128 * q->bs32[qi * 8 + j]);
        for (int t = 0; t < 8; t++) s = _mm512_dpbusd_epi32(s, w[t], _mm512_set1_epi32(ld32(x + 4 * t)));
        t8[i] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(s), t8[i]);
      }
    }
    for (int i = 0; i < mt; i++)
      acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(q->d[(m0 + i) * q->nb + ib]), t8[i], acc[i]);
  }
  for (int i = 0; i < mt; i++) _mm512_storeu_ps(res + R16 * i, acc[i]);
}
