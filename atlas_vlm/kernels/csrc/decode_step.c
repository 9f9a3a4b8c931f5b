/* Every decoder layer of a quantized model for one decode-only step, in one call, for
 * atlas_vlm/kernels/decode_step.py.
 *
 * The same functions the per-op path calls (quant_gemm.c's activation quantization and tiles,
 * fused_ops.c's norms / RoPE / SwiGLU, paged_decode.c's attention), in the same order with
 * the same roundings, so the result has the same bits as running the layers op by op; what
 * goes is the per-op cost around them: one OpenMP region for the whole step (barriers between
 * phases instead of a fork and join per op) and no Python between ops.
 *
 * Per layer, for B rows of D values (activations in the model dtype):
 *   h = norm_in(res [+= m])   qkv = h Wqkv   per (row, KV head): q, cache <- rope(qkv)
 *   then per (row, KV head): a = attend(q) over the row's first lens[row] keys
 *   o = a Wo   h = norm_post(res += o)   gu = h Wgu   s = silu_mul(gu)   m = s Wdown
 * A row is a decode token or a speculative verification row: a request's 1 + d rows are
 * consecutive with consecutive slots and lengths (all rows' K/V are written before any row
 * attends, so row j sees rows 0 .. j of its request and no later one).
 * then res += m and the final norm into x, and with a quantized LM head its logits (in the
 * dtype, [B, V]). A projection is int4 / int8 (quant_gemm.c) or a GGUF one as stored, its rows
 * interleaved (QLinear.gguf: gguf_gemm.c's q8_K kernels, its bias added in fp32, one rounding to
 * the dtype: gguf_gemm_packed's bits). Returns 0, or -1 for an input out of range (a slot
 * or context outside the cache / block table, a size the kernels refuse), checked before
 * anything is written, or a failed allocation.
 */
#include <omp.h>

#include "quant_gemm.c"
#include "fused_ops.c"
#include "paged_decode.c"
#include "gguf_gemm.c"

#define PREFETCH_CAP (512 << 10) /* bytes a thread prefetches ahead: well inside its L2 */

typedef struct { /* a GGUF projection as stored, its rows interleaved (gguf_gemm.c's gguf_repack) */
  const uint8_t *w[4]; /* up to 4 parts (a fused q / k / v or gate / up), outputs side by side */
  int64_t n[4];        /* each part's rows */
  int32_t type[4];     /* each part's ggml type: Q4_K, Q6_K or Q8_0 */
  int32_t nparts;
} GParts;

typedef struct {
  const void *w, *scale, *min; /* min NULL: no mins */
  const float *bias;           /* fp32 [N] or NULL */
  int64_t N, K, gs;
  int32_t scale_f16, int4; /* int4: the nibble layout, else int8 */
  const GParts *gguf;      /* non-NULL: a GGUF projection (q8_K activations, gguf_gemm.c's kernels) */
} QLinear;

typedef struct {
  QLinear qkv, o, gate_up, down;
  const void *in_norm, *post_norm, *q_norm, *k_norm; /* [D] / [Dh] in the dtype; q/k norm NULL but Qwen3 */
  void *k_cache, *v_cache;                           /* this layer's [num_slots, KV, Dh] */
} Layer;

typedef struct { /* per-step scratch, shared by the team */
  int8_t *xq;
  float *d, *xg;
  int32_t *xs;
  Q8K q8;    /* GGUF projections' q8_K activations (q8k_alloc for B rows of the widest K) */
  float *xf; /* their fp32 input rows */
} Quant;

/* Quantize a GEMM's input rows (one thread), then its tiles across the team (out[B, N] = in W):
 * a GGUF projection's to q8_K from the rows in fp32, as gguf_gemm_packed does. */
static void quantize_in(const QLinear *l, const void *in, int64_t B, int bf16, Quant *qs) {
  if (l->gguf != NULL) {
    for (int64_t r = 0; r < B; r++) load_row(in, r * l->K, l->K, bf16, qs->xf + r * l->K);
    qs->q8.K = l->K, qs->q8.nb = l->K / QK_K;
    quantize_q8_K(qs->xf, B, l->K, &qs->q8);
    return;
  }
  quantize_rows(in, bf16, B, l->K, l->gs, qs->xq, qs->d, qs->xs, l->min != NULL ? qs->xg : NULL);
}

/* Thread tid's tiles of the static schedule `omp for` gives a team of nt over T tiles. */
static void static_share(int64_t T, int tid, int nt, int64_t *t0, int64_t *t1) {
  const int64_t q = T / nt, r = T % nt;
  *t0 = tid * q + (tid < r ? tid : r);
  *t1 = *t0 + q + (tid < r);
}

/* While thread 0 does a step alone, the others pull the tiles they read next into their cache
 * (the weights stream from memory during the serial steps instead of after them). */
static void prefetch_share(const QLinear *l, int tid, int nt) {
  if (nt < 2 || l->gguf != NULL) return;
  const int64_t T = (l->N + TILE - 1) / TILE, tile_bytes = TILE * (l->int4 ? l->K / 2 : l->K);
  int64_t t0, t1;
  static_share(T, tid, nt, &t0, &t1);
  const char *w = (const char *)l->w + t0 * tile_bytes;
  int64_t n = (t1 - t0) * tile_bytes;
  n = n < PREFETCH_CAP ? n : PREFETCH_CAP;
  for (int64_t i = 0; i < n; i += 64) __builtin_prefetch(w + i, 0, 2);
}

/* A step for thread 0 alone, then a barrier; meanwhile the others prefetch `next`'s tiles. */
#define SERIAL(WORK, NEXT)                                                  \
  do {                                                                      \
    if (omp_get_thread_num() == 0) {                                        \
      WORK;                                                                 \
    } else {                                                                \
      prefetch_share((NEXT), omp_get_thread_num(), omp_get_num_threads()); \
    }                                                                       \
    _Pragma("omp barrier")                                                  \
  } while (0)

/* A GGUF projection across the team: thread tid's static share of all parts' 16-row groups. */
static void gguf_team(const QLinear *l, int64_t B, void *out, int bf16, const Quant *qs) {
  const GParts *p = l->gguf;
  int64_t T = 0, t0, t1, base = 0, col = 0;
  for (int i = 0; i < p->nparts; i++) T += (p->n[i] + R16 - 1) / R16;
  static_share(T, omp_get_thread_num(), omp_get_num_threads(), &t0, &t1);
  for (int i = 0; i < p->nparts; i++) {
    const int64_t G = (p->n[i] + R16 - 1) / R16, g0 = t0 - base > 0 ? t0 - base : 0, g1 = t1 - base < G ? t1 - base : G;
    if (g1 > g0)
      r16_range(p->w[i], p->type[i], p->n[i], &qs->q8, B, g0, g1, l->bias != NULL ? l->bias + col : NULL, out, l->N,
                col, bf16);
    base += G, col += p->n[i];
  }
#pragma omp barrier
}

static void tiles_team(const QLinear *l, int64_t B, void *out, int bf16, const Quant *qs) {
  if (l->gguf != NULL) {
    gguf_team(l, B, out, bf16, qs);
    return;
  }
  const Args a = {l->w, l->scale, l->min, l->scale_f16, l->int4, l->K, l->gs, qs->xq, qs->d, qs->xg, qs->xs};
#pragma omp for schedule(static)
  for (int64_t t = 0; t < (l->N + TILE - 1) / TILE; t++) tile_rows(&a, t, B, l->N, l->bias, out, bf16);
}

/* Row s, KV head kh: fused_ops.c's rope_kv_pair (the op-by-op path's bits): q into `q`, k / v
 * into the cache at slots[s]. */
static void rope_pair(const void *qkv, const void *cs, const void *sn, const Layer *ly, float eps,
                      const int64_t *slots, int64_t H, int64_t KV, int64_t Dh, void *q, int64_t s, int64_t kh,
                      int bf16) {
  float c[MAX_HEAD_DIM], sn_[MAX_HEAD_DIM], qn[MAX_HEAD_DIM], kn[MAX_HEAD_DIM];
  load_row(cs, s * Dh, Dh, bf16, c);
  load_row(sn, s * Dh, Dh, bf16, sn_);
  if (ly->q_norm != NULL) {
    load_row(ly->q_norm, 0, Dh, bf16, qn);
    load_row(ly->k_norm, 0, Dh, bf16, kn);
  }
  rope_kv_pair(qkv, c, sn_, ly->q_norm != NULL ? qn : NULL, ly->k_norm != NULL ? kn : NULL, eps, s, kh, H, KV, Dh, q,
               ly->k_cache, ly->v_cache, slots[s], bf16);
}

/* Row s, KV head kh: paged_decode.c's attention of its query over its first lens[s] keys. */
static int attend_pair(const Layer *ly, const int64_t *tables, int64_t stride, const int64_t *lens, int64_t H,
                       int64_t KV, int64_t Dh, int64_t bs, float scale, const void *q, void *att, int64_t s,
                       int64_t kh, int bf16) {
  if (bf16)
    return paged_decode_bf16_pair(q, ly->k_cache, ly->v_cache, tables, stride, lens, H, KV, Dh, bs, scale, att, s, kh);
  return paged_decode_f32_pair(q, ly->k_cache, ly->v_cache, tables, stride, lens, H, KV, Dh, bs, scale, att, s, kh);
}

int decode_layers(const Layer *layers, int64_t L, const void *final_norm, const QLinear *head, void *logits,
                  float eps, void *x, int64_t B, int64_t D,
                  int64_t H, int64_t KV, int64_t Dh, int64_t I, const void *cs, const void *sn, const int64_t *slots,
                  int64_t num_slots, const int64_t *tables, int64_t stride, const int64_t *lens, int64_t bs,
                  float scale, int bf16, int num_threads) {
  const int64_t group = KV > 0 ? H / KV : 0, QKV = (H + 2 * KV) * Dh, esz = bf16 ? 2 : 4;
  if (L < 1 || B < 1 || KV < 1 || group * KV != H || group > MAX_GROUP || Dh > MAX_DIM || D > MAX_ROW ||
      I > MAX_ROW || Dh % 2)
    return -1;
  for (int64_t s = 0; s < B; s++)
    if (slots[s] < 0 || slots[s] >= num_slots || lens[s] < 1 || (lens[s] + bs - 1) / bs > stride) return -1;
  int64_t kmax = D > I ? D : I;
  kmax = kmax > H * Dh ? kmax : H * Dh;
  if (head != NULL && (head->K != D || head->K % QBLOCK)) return -1;
  Quant qs = {malloc((size_t)(B * kmax)), malloc(sizeof(float) * (size_t)(B * kmax / QBLOCK)),
              malloc(sizeof(float) * (size_t)(B * kmax / 16)), malloc(sizeof(int32_t) * (size_t)(B * kmax / 16)),
              {0}, NULL};
  /* xg, xs: per group / unit, 16 values at the least (groups of 16) */
  char *buf = malloc((size_t)(esz * B * (3 * D + QKV + 2 * H * Dh + 3 * I)));
  int gguf = head != NULL && head->gguf != NULL, bad = 0;
  for (int64_t l = 0; l < L; l++)
    gguf |= layers[l].qkv.gguf != NULL || layers[l].o.gguf != NULL || layers[l].gate_up.gguf != NULL ||
            layers[l].down.gguf != NULL;
  if (gguf) /* q8_K scratch for the widest input */
    bad = kmax % QK_K || q8k_alloc(B, kmax, &qs.q8) || (qs.xf = malloc(sizeof(float) * (size_t)(B * kmax))) == NULL;
  if (bad || qs.xq == NULL || qs.d == NULL || qs.xg == NULL || qs.xs == NULL || buf == NULL) {
    free(qs.xq), free(qs.d), free(qs.xg), free(qs.xs), free(buf), free((void *)qs.q8.qs), free(qs.xf);
    return -1;
  }
  void *res = buf, *h = buf + esz * B * D, *m = buf + esz * B * 2 * D, *qkv = buf + esz * B * 3 * D;
  void *q = (char *)qkv + esz * B * QKV, *att = (char *)q + esz * B * H * Dh, *gu = (char *)att + esz * B * H * Dh;
  void *act = (char *)gu + esz * B * 2 * I;
  memcpy(res, x, (size_t)(esz * B * D));
  int status = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  { /* 9 barriers a layer: after each serial step, each for, the K/V writes and the attention */
    for (int64_t l = 0; l < L; l++) {
      const Layer *ly = layers + l;
      SERIAL((rms_norm(l == 0 ? res : m, l == 0 ? NULL : res, ly->in_norm, B, D, eps, h, bf16, 1),
              quantize_in(&ly->qkv, h, B, bf16, &qs)), &ly->qkv);
      tiles_team(&ly->qkv, B, qkv, bf16, &qs);
      /* every row's K/V into the cache first (the barrier of this for), then each row attends
       * its own context: a verification row reads the K/V of the rows before it */
#pragma omp for collapse(2) schedule(static)
      for (int64_t s = 0; s < B; s++)
        for (int64_t kh = 0; kh < KV; kh++) rope_pair(qkv, cs, sn, ly, eps, slots, H, KV, Dh, q, s, kh, bf16);
#pragma omp for collapse(2) schedule(dynamic, 1) nowait
      for (int64_t s = 0; s < B; s++)
        for (int64_t kh = 0; kh < KV; kh++)
          if (attend_pair(ly, tables, stride, lens, H, KV, Dh, bs, scale, q, att, s, kh, bf16) != 0) {
#pragma omp atomic write
            status = -1;
          }
      /* a thread done with its attention pulls in its share of o_proj's tiles */
      prefetch_share(&ly->o, omp_get_thread_num(), omp_get_num_threads());
#pragma omp barrier
      SERIAL(quantize_in(&ly->o, att, B, bf16, &qs), &ly->o);
      tiles_team(&ly->o, B, m, bf16, &qs);
      SERIAL((rms_norm(m, res, ly->post_norm, B, D, eps, h, bf16, 1), quantize_in(&ly->gate_up, h, B, bf16, &qs)),
             &ly->gate_up);
      tiles_team(&ly->gate_up, B, gu, bf16, &qs);
      SERIAL((silu_mul(gu, B, I, act, bf16, 1), quantize_in(&ly->down, act, B, bf16, &qs)), &ly->down);
      tiles_team(&ly->down, B, m, bf16, &qs);
    }
    if (head != NULL) { /* the LM head on the final norm's output: logits [B, V] in the dtype */
      SERIAL((rms_norm(m, res, final_norm, B, D, eps, x, bf16, 1), quantize_in(head, x, B, bf16, &qs)), head);
      tiles_team(head, B, logits, bf16, &qs);
    } else {
      SERIAL(rms_norm(m, res, final_norm, B, D, eps, x, bf16, 1), &layers[0].qkv);
    }
  }
  free(qs.xq), free(qs.d), free(qs.xg), free(qs.xs), free(buf), free((void *)qs.q8.qs), free(qs.xf);
  return status;
}
