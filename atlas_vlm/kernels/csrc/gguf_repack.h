/* GGUF rows repacked 16 at a time ("r16") for atlas_vlm/kernels/csrc/gguf_gemm.c (included
 * there), after ik_llama.cpp's row-interleaved q4_k_r4 / q6_k_r4 (iqk_quantize.cpp repack_q4_k,
 * repack_q6_k), widened to 16 rows so that one 512-bit vpdpbusd holds 4 values of each of 16
 * output rows, its activation operand one broadcast int32 (4 int8 values).
 *
 * Per group g of 16 rows (the last zero-padded) and super-block ib of 256 values, one packed
 * super-block (row r, value p of the 256; v the unsigned quant, 4 or 6 bits):
 *   Q4_K, 2368 bytes (148 a row against 144 stored):
 *     [0, 32) d[r] fp16   [32, 64) dmin[r] fp16   [64 + 16 j + r] scale of sub-block j (32 values)
 *     [192 + 32 t + 2 r + e] min of sub-block 2 t + e
 *     [320 + 64 (4 j + t) + 4 r + i] = v[32 j + 4 t + i] | v[32 j + 16 + 4 t + i] << 4
 *   Q6_K, 3360 bytes (210 a row, as stored):
 *     [0, 32) d[r] fp16   [32 + 16 s + r] int8 scale of sub-block s (16 values)
 *     [288 + 64 (4 c + t) + 4 r + i] = low4(v[32 c + 4 t + i]) | low4(v[32 c + 16 + 4 t + i]) << 4
 *     [2336 + 64 s + 4 r + i] = sum_t high2(v[16 s + 4 t + i]) << 2 t
 *   Q8_0, 4352 bytes (272 a row, as stored): [32 j + 2 r] fp16 d of block j (32 values)
 *     [256 + 64 (8 j + t) + 4 r + i] = v[32 j + 4 t + i] + 128 (unsigned; the 128 comes off
 *     through the activation's sums per 32: vpdpbusd started at -128 * bsum32)
 * Every variant computes per row the same int32s, sumi = sum_j scale_j * dot_j (Q6_K:
 * dot_j - 32 * bsum_j) and Q4_K's summ = sum_j min_j * bsum32_j, and then, per super-block,
 *   acc = fmaf(d_x * d, (float)sumi, acc)   (Q4_K: acc = fmaf(-d_x * dmin, (float)summ, acc))
 * in this order (Q8_0: t = fmaf(d_j, (float)dot_j, t) over the 8 blocks, then
 * acc = fmaf(d_x, t, acc)): the variants give the same bits. */

#define R16 16

static int64_t packed_super_bytes(int type) { /* bytes per 16 rows and 256 values */
  return type == GGML_Q4_K ? 2368 : type == GGML_Q6_K ? 3360 : type == GGML_Q8_0 ? 4352 : 0;
}

/* One stored super-block unpacked: w[256] unsigned quants in value order, sc / mn its scales. */
static void unpack_super(const uint8_t *b, int type, int32_t *w, int32_t *sc, int32_t *mn, float *dw) {
  if (type == GGML_Q6_K) {
    for (int h = 0; h < 2; h++)
      for (int l = 0; l < 64; l++) {
        const uint8_t ql = b[64 * h + l], qh = b[128 + 32 * h + l % 32] >> (l < 32 ? 0 : 2);
        w[128 * h + l] = (ql & 15) | (qh & 3) << 4;
        w[128 * h + 64 + l] = (ql >> 4) | ((qh >> 4) & 3) << 4;
      }
    for (int j = 0; j < 16; j++) sc[j] = (int8_t)b[192 + j];
    dw[0] = f16_at(b + 208);
  } else if (type == GGML_Q8_0) {
    for (int j = 0; j < 8; j++) {
      dw[j] = f16_at(b + 34 * j);
      for (int l = 0; l < 32; l++) w[32 * j + l] = (int8_t)b[34 * j + 2 + l];
    }
  } else { /* Q4_K, Q5_K */
    const int five = type == GGML_Q5_K;
    const uint8_t *qs = b + (five ? 48 : 16);
    uint32_t u[4];
    unpack_k4_scales(b + 4, u);
    for (int j = 0; j < 8; j++) sc[j] = ((const uint8_t *)u)[j], mn[j] = ((const uint8_t *)u)[8 + j];
    for (int j = 0; j < 8; j++)
      for (int l = 0; l < 32; l++)
        w[32 * j + l] = ((qs[32 * (j / 2) + l] >> (j % 2 ? 4 : 0)) & 15) | (five ? ((b[16 + l] >> j) & 1) << 4 : 0);
    dw[0] = f16_at(b), dw[1] = f16_at(b + 2);
  }
}

/* stored block b of row r -> its part of packed super-block o (zeroed before) */
static void pack_row(const uint8_t *b, int type, int r, uint8_t *o) {
  int32_t v[QK_K], sc[16], mn[8];
  float dw[8];
  unpack_super(b, type, v, sc, mn, dw);
  if (type == GGML_Q4_K) {
    memcpy(o + 2 * r, b, 2), memcpy(o + 32 + 2 * r, b + 2, 2);
    for (int j = 0; j < 8; j++) o[64 + 16 * j + r] = (uint8_t)sc[j], o[192 + 32 * (j / 2) + 2 * r + j % 2] = (uint8_t)mn[j];
    for (int j = 0; j < 8; j++)
      for (int t = 0; t < 4; t++)
        for (int i = 0; i < 4; i++)
          o[320 + 64 * (4 * j + t) + 4 * r + i] = (uint8_t)(v[32 * j + 4 * t + i] | v[32 * j + 16 + 4 * t + i] << 4);
  } else if (type == GGML_Q8_0) {
    for (int j = 0; j < 8; j++) {
      memcpy(o + 32 * j + 2 * r, b + 34 * j, 2);
      for (int t = 0; t < 8; t++)
        for (int i = 0; i < 4; i++) o[256 + 64 * (8 * j + t) + 4 * r + i] = (uint8_t)(v[32 * j + 4 * t + i] + 128);
    }
  } else {
    memcpy(o + 2 * r, b + 208, 2);
    for (int s = 0; s < 16; s++) o[32 + 16 * s + r] = (uint8_t)sc[s];
    for (int c = 0; c < 8; c++)
      for (int t = 0; t < 4; t++)
        for (int i = 0; i < 4; i++)
          o[288 + 64 * (4 * c + t) + 4 * r + i] = (uint8_t)((v[32 * c + 4 * t + i] & 15) | (v[32 * c + 16 + 4 * t + i] & 15) << 4);
    for (int s = 0; s < 16; s++)
      for (int t = 0; t < 4; t++)
        for (int i = 0; i < 4; i++) o[2336 + 64 * s + 4 * r + i] |= (uint8_t)((v[16 * s + 4 * t + i] >> 4) << 2 * t);
  }
}

/* plain C on one packed group: res[i * 16 + r] for activation rows m0 .. m0 + mt - 1 */
__attribute__((unused)) static void r16_plain(const uint8_t *g, int type, const Q8K *q, int64_t m0, int mt, float *res) {
  const int64_t sb = packed_super_bytes(type);
  for (int i = 0; i < mt * R16; i++) res[i] = 0.0f;
  for (int64_t ib = 0; ib < q->nb; ib++) {
    const uint8_t *b = g + ib * sb;
    for (int i = 0; i < mt; i++) {
      const int64_t qi = (m0 + i) * q->nb + ib;
      const int8_t *x = q->qs + (m0 + i) * q->K + ib * QK_K;
      const float dx = q->d[qi];
      for (int r = 0; r < R16; r++) {
        int32_t sumi = 0, summ = 0;
        if (type == GGML_Q4_K) {
          for (int j = 0; j < 8; j++) {
            int32_t dot = 0;
            for (int t = 0; t < 4; t++)
              for (int i4 = 0; i4 < 4; i4++) {
                const uint8_t byte = b[320 + 64 * (4 * j + t) + 4 * r + i4];
                dot += (byte & 15) * x[32 * j + 4 * t + i4] + (byte >> 4) * x[32 * j + 16 + 4 * t + i4];
              }
            sumi += b[64 + 16 * j + r] * dot;
            summ += b[192 + 32 * (j / 2) + 2 * r + j % 2] * q->bs32[qi * 8 + j];
          }
          res[i * R16 + r] = fmaf(dx * f16_at(b + 2 * r), (float)sumi, res[i * R16 + r]);
          res[i * R16 + r] = fmaf(-dx * f16_at(b + 32 + 2 * r), (float)summ, res[i * R16 + r]);
        } else if (type == GGML_Q8_0) {
          float t8 = 0.0f;
          for (int j = 0; j < 8; j++) {
            int32_t dot = 0;
            for (int l = 0; l < 32; l++) dot += (b[256 + 64 * (8 * j + l / 4) + 4 * r + l % 4] - 128) * x[32 * j + l];
            t8 = fmaf(f16_at(b + 32 * j + 2 * r), (float)dot, t8);
          }
          res[i * R16 + r] = fmaf(dx, t8, res[i * R16 + r]);
        } else {
          for (int s = 0; s < 16; s++) {
            int32_t dot = q->b6[qi * 16 + s];
            for (int t = 0; t < 4; t++)
              for (int i4 = 0; i4 < 4; i4++) {
                const int lo = (b[288 + 64 * (4 * (s / 2) + t) + 4 * r + i4] >> (s % 2 ? 4 : 0)) & 15;
                const int hi = (b[2336 + 64 * s + 4 * r + i4] >> 2 * t) & 3;
                dot += (lo | hi << 4) * x[16 * s + 4 * t + i4];
              }
            sumi += (int8_t)b[32 + 16 * s + r] * dot;
          }
          res[i * R16 + r] = fmaf(dx * f16_at(b + 2 * r), (float)sumi, res[i * R16 + r]);
        }
      }
    }
  }
}
