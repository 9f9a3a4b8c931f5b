/* The interleaved (16-row) path's entry points, included at the end of gguf_gemm.c (it needs
 * that file's q8_K quantizer and its row kernels by ISA): the packed size, the repack, the
 * per-thread range (what decode_step.c calls) and gguf_gemm_packed. Layout: gguf_repack.h. */

/* Bytes of N rows of K values of `type` repacked 16 rows at a time; 0: no r16 kernel for it. */
int64_t gguf_packed_bytes(int type, int64_t N, int64_t K) {
  if (N < 1 || K < QK_K || K % QK_K) return 0;
  return (N + R16 - 1) / R16 * (K / QK_K) * packed_super_bytes(type);
}

/* The stored rows w [N][row bytes] -> dst (gguf_packed_bytes) in the layout of gguf_repack.h. */
int gguf_repack(const uint8_t *w, int type, int64_t N, int64_t K, uint8_t *dst, int num_threads) {
  const int64_t sb = packed_super_bytes(type), bb = block_bytes(type), nb = K / QK_K, G = (N + R16 - 1) / R16;
  if (gguf_packed_bytes(type, N, K) == 0) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && G > 1)
  for (int64_t g = 0; g < G; g++)
    for (int64_t ib = 0; ib < nb; ib++) {
      uint8_t *o = dst + (g * nb + ib) * sb;
      memset(o, 0, (size_t)sb);
      for (int r = 0; r < R16 && g * R16 + r < N; r++) pack_row(w + ((g * R16 + r) * nb + ib) * bb, type, r, o);
    }
  return 0;
}

/* packed group g against activation rows m0 .. m0 + mt - 1 -> res[i * 16 + r] */
static void r16_group(const uint8_t *g, int type, const Q8K *q, int64_t m0, int mt, float *res) {
#if defined(GG_PLAIN)
  r16_plain(g, type, q, m0, mt, res);
#else
#define R4(n) q4k_r16(g, q, m0, n, res)
#define R6(n) q6k_r16(g, q, m0, n, res)
#define R8(n) q80_r16(g, q, m0, n, res)
  if (type == GGML_Q4_K) GG_CASES(R4) else if (type == GGML_Q6_K) GG_CASES(R6) else GG_CASES(R8)
#endif
}

/* groups [g0, g1) of a packed weight of N rows against all M rows of q, plus bias (fp32 [N] or
 * NULL, added in fp32): columns col0 .. of out [M][ldo], fp32 or (out_bf16) bf16 rounded to
 * nearest even (as torch's .to(bfloat16)); one thread's share. */
static void r16_range(const uint8_t *p, int type, int64_t N, const Q8K *q, int64_t M, int64_t g0, int64_t g1,
                      const float *bias, void *out, int64_t ldo, int64_t col0, int out_bf16) {
  const int64_t gb = q->nb * packed_super_bytes(type);
  float res[MAX_ROWS * R16];
#ifdef GG_Q6_PRE
  __m512i *pre = type == GGML_Q6_K && M > MAX_ROWS ? aligned_alloc(64, (size_t)(q->nb * 4096)) : NULL;
#endif
  for (int64_t g = g0; g < g1; g++) {
    const int nv = N - g * R16 < R16 ? (int)(N - g * R16) : R16;
#ifdef GG_Q6_PRE
    if (pre != NULL)
      for (int64_t ib = 0; ib < q->nb; ib++) q6_unpack(p + g * gb + ib * 3360, pre + 64 * ib);
#endif
    for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
      const int mt = M - m0 < MAX_ROWS ? (int)(M - m0) : MAX_ROWS;
#ifdef GG_Q6_PRE
      if (pre != NULL) {
#define R6P(n) q6k_r16_w(p + g * gb, pre, q, m0, n, res)
        GG_CASES(R6P)
      } else
#endif
        r16_group(p + g * gb, type, q, m0, mt, res);
      for (int i = 0; i < mt; i++)
        for (int r = 0; r < nv; r++) {
          const float v = bias != NULL ? res[i * R16 + r] + bias[g * R16 + r] : res[i * R16 + r];
          const int64_t at = (m0 + i) * ldo + col0 + g * R16 + r;
          if (out_bf16) ((uint16_t *)out)[at] = f32_to_bf16(v);
          else ((float *)out)[at] = v;
        }
    }
  }
#ifdef GG_Q6_PRE
  free(pre);
#endif
}

/* y = x W^T (+ bias, fp32 [N] or NULL) on a packed weight (gguf_repack): as gguf_gemm, Q4_K, Q6_K, Q8_0. */
int gguf_gemm_packed(const float *x, int64_t M, int64_t K, const uint8_t *p, int type, int64_t N, const float *bias,
                     float *out, int num_threads) {
  const int64_t G = (N + R16 - 1) / R16;
  Q8K q;
  if (gguf_packed_bytes(type, N, K) == 0 || M < 1 || q8k_alloc(M, K, &q)) return -1;
  quantize_q8_K(x, M, K, &q);
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && G > 1)
  {
    int64_t g0 = 0, g1 = G;
#ifdef _OPENMP
    const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
    g0 = G * tid / nt, g1 = G * (tid + 1) / nt;
#endif
    r16_range(p, type, N, &q, M, g0, g1, bias, out, N, 0, 0);
  }
  free((void *)q.qs);
  return 0;
}
