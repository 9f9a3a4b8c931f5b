/* AVX2 row kernels of atlas_vlm/kernels/csrc/gguf_gemm.c (included there, not built on its own),
 * after ik_llama.cpp's iqk_gemm_kquants.cpp: per super-block the weights unpacked once into 8
 * vectors of 32 unsigned values in x's order, then per activation row (up to 8)
 *   p = vpmaddubsw(w, x)          int16, sums of 2 products (|p| <= 2 * 63 * 127: no saturation)
 *   sumi += vpmaddwd(p, scales)   int32, each pair times its sub-block's scale
 *   acc = fma(d_x * d_w, float(sumi), acc)   one fp32 FMA per 256 and row
 * Q4_K / Q5_K mins through the activation bsums (vpmaddwd with [m_j, m_j] pairs), Q6_K's -32 as
 * 32 * sum_j scale_j * bsum_j taken off sumi; the same integers as the AVX-512 variant. */
#include <immintrin.h>

static inline __m256i dot16(__m256i sumi, __m256i w, const int8_t *x, __m256i s) {
  return _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i *)x)), s));
}

static inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

/* Q4_K (five = 0) and Q5_K: vector j (values 32j .. 32j + 31) is sub-block j: nibbles of qs[32 (j / 2) ..]. */
static inline __attribute__((always_inline)) void k4_rows(const uint8_t *row, const Q8K *q, int64_t m0, const int mt,
                                                          float *res, int five) {
  const int64_t bb = five ? 176 : 144;
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  __m256 acc[MAX_ROWS];
  for (int i = 0; i < mt; i++) acc[i] = _mm256_setzero_ps();
  for (int64_t ib = 0; ib < q->nb; ib++) {
    const uint8_t *b = row + ib * bb, *qs = b + (five ? 48 : 16);
    const float d = f16_at(b), dmin = f16_at(b + 2);
    uint32_t u[4];
    unpack_k4_scales(b + 4, u);
    const uint8_t *sc = (const uint8_t *)u;
    __m256i w[8], s[8];
    const __m256i h = five ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
      const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
      w[2 * c] = _mm256_and_si256(v, m4);
      w[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    }
    for (int j = 0; j < 8; j++) {
      s[j] = _mm256_set1_epi16(sc[j]);
      if (five) { /* bit j of qh[l]: the fifth bit of value l of sub-block j */
        const __m256i bit = _mm256_set1_epi8((char)(1 << j));
        w[j] = _mm256_or_si256(w[j], _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit),
                                                      _mm256_set1_epi8(16)));
      }
    }
    const __m256i mn = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(u + 2)));
    const __m256i mpair = _mm256_or_si256(mn, _mm256_slli_epi32(mn, 16)); /* [m_j, m_j] as int16 */
    for (int i = 0; i < mt; i++) {
      const int8_t *x = q->qs + (m0 + i) * q->K + ib * QK_K;
      __m256i sumi = _mm256_setzero_si256();
      for (int j = 0; j < 8; j++) sumi = dot16(sumi, w[j], x + 32 * j, s[j]);
      const float dx = q->d[(m0 + i) * q->nb + ib];
      const __m256i bs = _mm256_loadu_si256((const __m256i *)(q->bsums + ((m0 + i) * q->nb + ib) * 16));
      acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(dx * d), _mm256_cvtepi32_ps(sumi), acc[i]);
      acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(-dx * dmin), _mm256_cvtepi32_ps(_mm256_madd_epi16(bs, mpair)), acc[i]);
    }
  }
  for (int i = 0; i < mt; i++) res[i] = hsum8(acc[i]);
}

/* Q6_K: vector j (values 32j .. 32j + 31, sub-blocks 2j and 2j + 1) from ql's nibbles and qh's bit pairs. */
static inline __attribute__((always_inline)) void q6_rows(const uint8_t *row, const Q8K *q, int64_t m0, const int mt,
                                                          float *res) {
  const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(3);
  __m256 acc[MAX_ROWS];
  for (int i = 0; i < mt; i++) acc[i] = _mm256_setzero_ps();
  for (int64_t ib = 0; ib < q->nb; ib++) {
    const uint8_t *b = row + ib * 210;
    const float d = f16_at(b + 208);
    const int8_t *sc = (const int8_t *)(b + 192);
    __m256i w[8], s[8];
    for (int h = 0; h < 2; h++) {
      const __m256i l0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
      const __m256i l1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
      const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
      const __m256i hb[4] = {qh, _mm256_srli_epi16(qh, 2), _mm256_srli_epi16(qh, 4), _mm256_srli_epi16(qh, 6)};
      const __m256i lo[4] = {_mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
                             _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                             _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};
      for (int c = 0; c < 4; c++)
        w[4 * h + c] = _mm256_or_si256(lo[c], _mm256_slli_epi16(_mm256_and_si256(hb[c], m2), 4));
    }
    for (int j = 0; j < 8; j++) s[j] = _mm256_set_m128i(_mm_set1_epi16(sc[2 * j + 1]), _mm_set1_epi16(sc[2 * j]));
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
    for (int i = 0; i < mt; i++) {
      const int8_t *x = q->qs + (m0 + i) * q->K + ib * QK_K;
      __m256i sumi = _mm256_setzero_si256();
      for (int j = 0; j < 8; j++) sumi = dot16(sumi, w[j], x + 32 * j, s[j]);
      const __m256i bs = _mm256_loadu_si256((const __m256i *)(q->bsums + ((m0 + i) * q->nb + ib) * 16));
      sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(_mm256_madd_epi16(bs, sc16), 5));
      acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(q->d[(m0 + i) * q->nb + ib] * d), _mm256_cvtepi32_ps(sumi), acc[i]);
    }
  }
  for (int i = 0; i < mt; i++) res[i] = hsum8(acc[i]);
}

/* Q8_0: |w| times x with w's sign (vpsignb), |pair| <= 2 * 128 * 127: no saturation. */
static inline __attribute__((always_inline)) void q8_0_rows(const uint8_t *row, const Q8K *q, int64_t m0, const int mt,
                                                            float *res) {
  const __m256i one = _mm256_set1_epi16(1);
  __m256 acc[MAX_ROWS];
  for (int i = 0; i < mt; i++) acc[i] = _mm256_setzero_ps();
  for (int64_t ib = 0; ib < q->nb; ib++) {
    const uint8_t *b = row + ib * 8 * 34;
    __m256i v[8], aw[8];
    float ds[8];
    for (int j = 0; j < 8; j++) {
      v[j] = _mm256_loadu_si256((const __m256i *)(b + 34 * j + 2));
      aw[j] = _mm256_sign_epi8(v[j], v[j]);
      ds[j] = f16_at(b + 34 * j);
    }
    for (int i = 0; i < mt; i++) {
      const int8_t *x = q->qs + (m0 + i) * q->K + ib * QK_K;
      __m256 t = _mm256_setzero_ps();
      for (int j = 0; j < 8; j++) {
        const __m256i xs = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(x + 32 * j)), v[j]);
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw[j], xs), one);
        t = _mm256_fmadd_ps(_mm256_set1_ps(ds[j]), _mm256_cvtepi32_ps(p), t);
      }
      acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(q->d[(m0 + i) * q->nb + ib]), t, acc[i]);
    }
  }
  for (int i = 0; i < mt; i++) res[i] = hsum8(acc[i]);
}
