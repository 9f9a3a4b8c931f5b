/* One decode-attention kernel body, included once per (cache format, q dtype) by
 * paged_decode.c (K/V in q's dtype) and paged_decode_q8.c (8-bit codes + scales): the same
 * loops, scores, softmax and accumulation in fp32 whatever the cache holds.
 *
 * Before each #include, define:
 *   PD_NAME                the exported function (PD_NAME##_pair is the per-pair worker)
 *   PD_T                   q's and out's element type; PD_LOAD(p, i) / PD_STORE(p, i, x)
 *   PD_CACHE_PARAMS        the cache parameters that follow q in both signatures
 *   PD_CACHE_ARGS          the same names, to pass them on
 *   PD_READ_ROW(which, b, i)  fill row[0..head_dim) with the values of token i of block b's
 *                          KV head h, up to one factor; which is k or v (names k_cache /
 *                          k_scale ... in scope)
 *   PD_ROW_SCALE(which, b, i) that factor (a float expression; 1.0f for a plain cache): it
 *                          multiplies the q.k dot product once (K) and the softmax weight of
 *                          the token once (V), not every element
 *   PD_ROTATE(x)           rotate x[0..head_dim) in place (an orthonormal, symmetric map: the
 *                          cache holds K and V rotated; q is rotated once after scaling and
 *                          the output once before storing); nothing for a plain cache
 * Every PD_ macro is undefined at the end, ready for the next inclusion.
 */
/* The includer defines PD_MAX_GROUP / PD_MAX_DIM (the bounds of the scratch arrays) and
 * PD_PAIR(name) (name##_pair) once. */

/* One (request s, KV head h) pair: its query heads against its context. Returns 0, or -1 when
 * the context does not fit the block table or scratch memory is missing (nothing written). */
static int PD_PAIR(PD_NAME)(const PD_T *q, PD_CACHE_PARAMS, const int64_t *block_tables, int64_t table_stride,
                            const int64_t *context_lens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t block_size, float scale, PD_T *out, int64_t s, int64_t h) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t block_stride = block_size * token_stride;
  const int64_t len = context_lens[s];
  const int64_t *blocks = block_tables + s * table_stride;
  if (len < 1 || (len + block_size - 1) / block_size > table_stride) return -1;
  float qf[PD_MAX_GROUP][PD_MAX_DIM], acc[PD_MAX_GROUP][PD_MAX_DIM], row[PD_MAX_DIM], mx[PD_MAX_GROUP];
  float *scores = (float *)malloc(sizeof(float) * group * len); /* [group, len] */
  if (scores == NULL) return -1;
  for (int64_t g = 0; g < group; g++) {
    const int64_t qoff = (s * num_heads + h * group + g) * head_dim;
    for (int64_t d = 0; d < head_dim; d++) qf[g][d] = PD_LOAD(q, qoff + d) * scale;
    for (int64_t d = 0; d < head_dim; d++) acc[g][d] = 0.0f;
    PD_ROTATE(qf[g]);
    mx[g] = -INFINITY;
  }
  /* scores = q . k for every context token, read block by block */
  for (int64_t t0 = 0; t0 < len; t0 += block_size) {
    const int64_t b = blocks[t0 / block_size];
    const int64_t n = len - t0 < block_size ? len - t0 : block_size;
    for (int64_t i = 0; i < n; i++) {
      PD_READ_ROW(k, b, i);
      const float row_scale = PD_ROW_SCALE(k, b, i);
      for (int64_t g = 0; g < group; g++) {
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < head_dim; d++) dot += qf[g][d] * row[d];
        dot *= row_scale;
        scores[g * len + t0 + i] = dot;
        if (dot > mx[g]) mx[g] = dot;
      }
    }
  }
  float inv[PD_MAX_GROUP];
  for (int64_t g = 0; g < group; g++) {
    float sum = 0.0f;
    float *sg = scores + g * len;
    const float m = mx[g];
#pragma omp simd reduction(+ : sum) /* vector expf (libmvec) with -fno-math-errno */
    for (int64_t t = 0; t < len; t++) {
      const float e = expf(sg[t] - m);
      sg[t] = e;
      sum += e;
    }
    inv[g] = 1.0f / sum;
  }
  /* out = softmax . v */
  for (int64_t t0 = 0; t0 < len; t0 += block_size) {
    const int64_t b = blocks[t0 / block_size];
    const int64_t n = len - t0 < block_size ? len - t0 : block_size;
    for (int64_t i = 0; i < n; i++) {
      PD_READ_ROW(v, b, i);
      const float row_scale = PD_ROW_SCALE(v, b, i);
      for (int64_t g = 0; g < group; g++) {
        const float w = scores[g * len + t0 + i] * row_scale;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++) acc[g][d] += w * row[d];
      }
    }
  }
  for (int64_t g = 0; g < group; g++) {
    const int64_t ooff = (s * num_heads + h * group + g) * head_dim;
    PD_ROTATE(acc[g]);
    for (int64_t d = 0; d < head_dim; d++) PD_STORE(out, ooff + d, acc[g][d] * inv[g]);
  }
  free(scores);
  (void)block_stride;
  return 0;
}

int PD_NAME(const PD_T *q, PD_CACHE_PARAMS, const int64_t *block_tables, int64_t table_stride,
            const int64_t *context_lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
            int64_t block_size, float scale, PD_T *out, int num_threads) {
  const int64_t group = num_heads / num_kv_heads;
  if (head_dim > PD_MAX_DIM || group > PD_MAX_GROUP || group * num_kv_heads != num_heads) return -1;
  int status = 0;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)
  for (int64_t s = 0; s < num_seqs; s++) {
    for (int64_t h = 0; h < num_kv_heads; h++) {
      if (PD_PAIR(PD_NAME)(q, PD_CACHE_ARGS, block_tables, table_stride, context_lens, num_heads, num_kv_heads,
                           head_dim, block_size, scale, out, s, h) != 0) {
#pragma omp atomic write
        status = -1;
      }
    }
  }
  return status;
}

#undef PD_NAME
#undef PD_T
#undef PD_LOAD
#undef PD_STORE
#undef PD_CACHE_PARAMS
#undef PD_CACHE_ARGS
#undef PD_READ_ROW
#undef PD_ROW_SCALE
#undef PD_ROTATE
