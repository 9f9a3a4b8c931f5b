/* AVX512-VNNI row kernels of atlas_vlm/kernels/csrc/gguf_gemm.c (included there, not built on
 * its own), after ik_llama.cpp's iqk_gemm_kquants.cpp: per super-block of 256 the weights are
 * unpacked once into 4 vectors of 64 unsigned values (x's order, so an activation row is read
 * with plain 64-byte loads) and multiplied against up to 8 activation rows:
 *   p = vpdpbusd(0, w, x)         int32 lanes, each the sum of 4 products (|p| <= 4 * 63 * 127)
 *   sumi = vpdpwssd(sumi, p, s)   s: the sub-block's scale in each lane's low 16 bits, 0 above,
 *                                 so a lane adds p * scale exactly (p fits in int16)
 *   acc = fma(d_x * d_w, float(sumi), acc)   one fp32 FMA per 256 and row
 * Q4_K / Q5_K mins: vpmaddwd of the activation's 16 bsums with [m_j, m_j] pairs, one more FMA
 * with -d_x * dmin; Q6_K's -32: 32 * sum_j scale_j * bsum_j taken off sumi, in int32. */
#include <immintrin.h>

static inline __m512i lo_hi_nibbles(const uint8_t *p) { /* 32 bytes -> [low nibbles | high nibbles] */
  const __m256i v = _mm256_loadu_si256((const __m256i *)p);
  return _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1),
                          _mm512_set1_epi8(0x0f));
}

static inline __m512i dot_scaled(__m512i sumi, __m512i w, const int8_t *x, __m512i s) {
  return _mm512_dpwssd_epi32(sumi, _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(x)), s);
}

/* Q4_K (qh NULL) and Q5_K: sub-block j of 32 uses scale sc_j and min m_j; chunk c of 64 values
 * holds sub-blocks 2c (lanes 0-7) and 2c + 1 (lanes 8-15). */
static inline __attribute__((always_inline)) void k4_rows(const uint8_t *row, const Q8K *q, int64_t m0, const int mt,
                                                          float *res, int five) {
  const int64_t bb = five ? 176 : 144;
  __m512 acc[MAX_ROWS];
  for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
  for (int64_t ib = 0; ib < q->nb; ib++) {
    const uint8_t *b = row + ib * bb, *qs = b + (five ? 48 : 16);
    const float d = f16_at(b), dmin = f16_at(b + 2);
    uint32_t u[4];
    unpack_k4_scales(b + 4, u);
    const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)u)); /* sc0..7, m0..7 */
    __m512i w[4], s[4];
    for (int c = 0; c < 4; c++) {
      w[c] = lo_hi_nibbles(qs + 32 * c);
      s[c] = _mm512_permutexvar_epi32(_mm512_set_epi32(2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1,
                                                       2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c, 2 * c, 2 * c, 2 * c,
                                                       2 * c, 2 * c, 2 * c, 2 * c), sc);
    }
    if (five) { /* bit 2c of qh[l] is the fifth bit of value l of sub-block 2c, bit 2c + 1 of 2c + 1 */
      const __m256i h = _mm256_loadu_si256((const __m256i *)(b + 16));
      const __m512i hz = _mm512_inserti64x4(_mm512_castsi256_si512(h), h, 1);
      for (int c = 0; c < 4; c++) {
        const __m512i bit = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi8((char)(1 << 2 * c))),
                                               _mm256_set1_epi8((char)(2 << 2 * c)), 1);
        w[c] = _mm512_mask_add_epi8(w[c], _mm512_test_epi8_mask(hz, bit), w[c], _mm512_set1_epi8(16));
      }
    }
    const __m256i mn = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(u + 2)));
    const __m256i mpair = _mm256_or_si256(mn, _mm256_slli_epi32(mn, 16)); /* [m_j, m_j] as int16 */
    for (int i = 0; i < mt; i++) {
      const int8_t *x = q->qs + (m0 + i) * q->K + ib * QK_K;
      const __m512i sumi = _mm512_add_epi32(dot_scaled(dot_scaled(_mm512_setzero_si512(), w[0], x, s[0]), w[1], x + 64, s[1]),
                                            dot_scaled(dot_scaled(_mm512_setzero_si512(), w[2], x + 128, s[2]), w[3], x + 192, s[3]));
      const float dx = q->d[(m0 + i) * q->nb + ib];
      const __m256i bs = _mm256_loadu_si256((const __m256i *)(q->bsums + ((m0 + i) * q->nb + ib) * 16));
      const __m256i summ = _mm256_madd_epi16(bs, mpair);
      acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(dx * d), _mm512_cvtepi32_ps(sumi), acc[i]);
      acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(-dx * dmin), _mm512_cvtepi32_ps(_mm512_zextsi256_si512(summ)), acc[i]);
    }
  }
  for (int i = 0; i < mt; i++) res[i] = _mm512_reduce_add_ps(acc[i]);
}

/* Q6_K: half h of 128 values: ql[64h .. 64h + 63] low nibbles = x[128h .. +63], high nibbles
 * = x[128h + 64 .. +127]; qh[32h + l] bits 0-1, 2-3, 4-5, 6-7 the top two bits of values l,
 * l + 32, l + 64, l + 96; int8 scale j per 16 values (lanes 4j .. 4j + 3 of chunk j / 4). */
static inline __attribute__((always_inline)) void q6_rows(const uint8_t *row, const Q8K *q, int64_t m0, const int mt,
                                                          float *res) {
  __m512 acc[MAX_ROWS];
  for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(0x0f), m2 = _mm512_set1_epi8(3), lo16 = _mm512_set1_epi32(0xffff);
  for (int64_t ib = 0; ib < q->nb; ib++) {
    const uint8_t *b = row + ib * 210;
    const float d = f16_at(b + 208);
    const __m128i sc8 = _mm_loadu_si128((const __m128i *)(b + 192));
    const __m512i sc = _mm512_and_si512(_mm512_cvtepi8_epi32(sc8), lo16);
    __m512i w[4], s[4];
    for (int h = 0; h < 2; h++) {
      const __m512i l = _mm512_loadu_si512((const void *)(b + 64 * h));
      const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
      const __m512i hz = _mm512_inserti64x4(_mm512_castsi256_si512(qh), qh, 1);
      const __m512i h0 = _mm512_srlv_epi16(hz, _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1));
      const __m512i h1 = _mm512_srlv_epi16(hz, _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1));
      w[2 * h] = _mm512_or_si512(_mm512_and_si512(l, m4), _mm512_slli_epi16(_mm512_and_si512(h0, m2), 4));
      w[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4),
                                     _mm512_slli_epi16(_mm512_and_si512(h1, m2), 4));
    }
    for (int c = 0; c < 4; c++) {
      const int j = 4 * c;
      s[c] = _mm512_permutexvar_epi32(_mm512_set_epi32(j + 3, j + 3, j + 3, j + 3, j + 2, j + 2, j + 2, j + 2, j + 1,
                                                       j + 1, j + 1, j + 1, j, j, j, j), sc);
    }
    const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
    for (int i = 0; i < mt; i++) {
      const int8_t *x = q->qs + (m0 + i) * q->K + ib * QK_K;
      __m512i sumi = _mm512_setzero_si512();
      for (int c = 0; c < 4; c++) sumi = dot_scaled(sumi, w[c], x + 64 * c, s[c]);
      const __m256i bs = _mm256_loadu_si256((const __m256i *)(q->bsums + ((m0 + i) * q->nb + ib) * 16));
      const __m256i off = _mm256_slli_epi32(_mm256_madd_epi16(bs, sc16), 5); /* 32 * scale_j * bsum_j */
      sumi = _mm512_sub_epi32(sumi, _mm512_zextsi256_si512(off));
      acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(q->d[(m0 + i) * q->nb + ib] * d), _mm512_cvtepi32_ps(sumi), acc[i]);
    }
  }
  for (int i = 0; i < mt; i++) res[i] = _mm512_reduce_add_ps(acc[i]);
}

/* Q8_0: 8 blocks of 32 per 256, two a vector; |w| (u8) times x with w's sign, exact int32 per block. */
static inline __attribute__((always_inline)) void q8_0_rows(const uint8_t *row, const Q8K *q, int64_t m0, const int mt,
                                                            float *res) {
  __m512 acc[MAX_ROWS];
  for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
  for (int64_t ib = 0; ib < q->nb; ib++) {
    const uint8_t *b = row + ib * 8 * 34;
    __m512i aw[4];
    __mmask64 neg[4];
    __m512 ds[4];
    for (int c = 0; c < 4; c++) {
      const uint8_t *b0 = b + 2 * c * 34, *b1 = b0 + 34;
      const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2))),
                                           _mm256_loadu_si256((const __m256i *)(b1 + 2)), 1);
      aw[c] = _mm512_abs_epi8(v);
      neg[c] = _mm512_movepi8_mask(v);
      ds[c] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(f16_at(b0))),
                                 _mm256_set1_ps(f16_at(b1)), 1);
    }
    for (int i = 0; i < mt; i++) {
      const int8_t *x = q->qs + (m0 + i) * q->K + ib * QK_K;
      const __m512 dx = _mm512_set1_ps(q->d[(m0 + i) * q->nb + ib]);
      __m512 t = _mm512_setzero_ps();
      for (int c = 0; c < 4; c++) {
        const __m512i xv = _mm512_loadu_si512((const void *)(x + 64 * c));
        const __m512i xs = _mm512_mask_sub_epi8(xv, neg[c], _mm512_setzero_si512(), xv);
        t = _mm512_fmadd_ps(ds[c], _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), aw[c], xs)), t);
      }
      acc[i] = _mm512_fmadd_ps(dx, t, acc[i]);
    }
  }
  for (int i = 0; i < mt; i++) res[i] = _mm512_reduce_add_ps(acc[i]);
}
