/* One decode token per sequence through a Gated DeltaNet layer's token mixer (CPU), for
 * atlas_vlm/kernels/gated_delta.py. Rules: HF transformers 5.25 modeling_qwen3_5.py
 * (causal_conv1d_update, torch_recurrent_gated_delta_rule with use_qk_l2norm_in_kernel).
 *
 * Phase 1, for every (sequence, channel) in parallel: the depthwise causal conv1d over the
 * channel's window [conv state (kernel - 1 values), new input], SiLU, into fp32 scratch; the
 * conv state shifts left by one in place (its slot).
 * Phase 2, for every (sequence, value head) in parallel: q / k of the head's key head (value
 * head h reads key head h / (num_v_heads / num_k_heads), as HF's repeat_interleave) L2-normed
 * (eps 1e-6), q scaled by 1 / sqrt(k_head_dim); decay = exp(-exp(A_log) * softplus(a + dt_bias)),
 * beta = sigmoid(b); the fp32 state S [k_head_dim, v_head_dim] of the sequence's slot is
 * updated in place: S = decay * S; S += k (x) (v - S^T k) * beta; output S^T q.
 * A sequence whose has_initial flag is 0 starts from zero conv and recurrent state.
 *
 * bf16 inputs (is_bf16 = 1): qkv, a, b and out are bf16; the values PyTorch rounds to bf16
 * (conv state read as bf16, conv output, SiLU output, beta) are rounded here too; all sums in fp32.
 *
 * Shapes (row-major; qkv rows qkv_stride elements apart, everything else contiguous):
 *   qkv [n, conv_dim]; a, b [n, num_v_heads]; conv_w [conv_dim, kernel] fp32;
 *   A_log, dt_bias [num_v_heads] fp32; conv_state [num_slots, conv_dim, kernel - 1] fp32;
 *   rec_state [num_slots, num_v_heads, k_head_dim, v_head_dim] fp32; slots [n] int64;
 *   has_initial [n] uint8; scratch [n, conv_dim] fp32; out [n, num_v_heads, v_head_dim].
 *   conv_dim = 2 * num_k_heads * k_head_dim + num_v_heads * v_head_dim (q | k | v channels).
 * Returns 0, or -1 (nothing written) when a size is out of range (head dims <= 256,
 * 2 <= kernel <= 16, num_v_heads a multiple of num_k_heads, slots within num_slots).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define GD_MAX_DIM 256
#define GD_MAX_KERNEL 16

static inline float load_x(const void *p, int64_t i, int is_bf16) {
  return is_bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline float keep(float x, int is_bf16) { return is_bf16 ? round_bf16(x) : x; }

static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); } /* torch's threshold 20 */

static void conv_phase(const void *qkv, int64_t qkv_stride, const float *conv_w, float *conv_state,
                       const int64_t *slots, const uint8_t *has_initial, int64_t n, int64_t conv_dim,
                       int64_t kernel, float *scratch, int is_bf16, int threads) {
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static)
  for (int64_t i = 0; i < n; i++) {
    for (int64_t c = 0; c < conv_dim; c++) {
      float win[GD_MAX_KERNEL];
      float *st = conv_state + (slots[i] * conv_dim + c) * (kernel - 1);
      for (int64_t j = 0; j < kernel - 1; j++) win[j] = has_initial[i] ? keep(st[j], is_bf16) : 0.0f;
      win[kernel - 1] = load_x(qkv, i * qkv_stride + c, is_bf16);
      const float *w = conv_w + c * kernel;
      float y = 0.0f;
      for (int64_t j = 0; j < kernel; j++) y += w[j] * win[j];
      y = keep(y, is_bf16);
      scratch[i * conv_dim + c] = keep(y / (1.0f + expf(-y)), is_bf16);
      for (int64_t j = 0; j < kernel - 1; j++) st[j] = win[j + 1];
    }
  }
}

static void normalized(const float *x, int64_t dim, float scale, float *dst) {
  float ss = 0.0f;
  for (int64_t d = 0; d < dim; d++) ss += x[d] * x[d];
  const float inv = 1.0f / sqrtf(ss + 1e-6f);
  for (int64_t d = 0; d < dim; d++) dst[d] = x[d] * inv * scale;
}

static void delta_phase(const float *scratch, const void *a, const void *b, const float *A_log,
                        const float *dt_bias, float *rec_state, const int64_t *slots, const uint8_t *has_initial,
                        int64_t n, int64_t conv_dim, int64_t hk, int64_t hv, int64_t dk, int64_t dv, void *out,
                        int is_bf16, int threads) {
  const int64_t group = hv / hk, key_dim = hk * dk;
  const float q_scale = 1.0f / sqrtf((float)dk);
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static)
  for (int64_t i = 0; i < n; i++) {
    for (int64_t h = 0; h < hv; h++) {
      float q[GD_MAX_DIM], k[GD_MAX_DIM], kv_mem[GD_MAX_DIM], o[GD_MAX_DIM];
      const float *row = scratch + i * conv_dim;
      const int64_t kh = h / group;
      normalized(row + kh * dk, dk, 1.0f, q);
      for (int64_t d = 0; d < dk; d++) q[d] *= q_scale; /* HF: l2norm, then / sqrt(dk) */
      normalized(row + key_dim + kh * dk, dk, 1.0f, k);
      const float *v = row + 2 * key_dim + h * dv;
      const float g = -expf(A_log[h]) * softplus(load_x(a, i * hv + h, is_bf16) + dt_bias[h]);
      const float decay = expf(g);
      const float beta = keep(1.0f / (1.0f + expf(-load_x(b, i * hv + h, is_bf16))), is_bf16);
      float *S = rec_state + (slots[i] * hv + h) * dk * dv;
      if (!has_initial[i]) memset(S, 0, sizeof(float) * dk * dv);
      for (int64_t e = 0; e < dv; e++) kv_mem[e] = 0.0f, o[e] = 0.0f;
      for (int64_t d = 0; d < dk; d++) { /* read-only pass: kv_mem = (decay * S)^T k */
        const float *Sd = S + d * dv;
        const float kd = k[d] * decay;
        for (int64_t e = 0; e < dv; e++) kv_mem[e] += Sd[e] * kd;
      }
      for (int64_t e = 0; e < dv; e++) kv_mem[e] = (v[e] - kv_mem[e]) * beta; /* delta */
      for (int64_t d = 0; d < dk; d++) { /* one write pass: S = decay * S + k (x) delta; o = S^T q */
        float *Sd = S + d * dv;
        for (int64_t e = 0; e < dv; e++) {
          Sd[e] = Sd[e] * decay + k[d] * kv_mem[e];
          o[e] += Sd[e] * q[d];
        }
      }
      const int64_t base = (i * hv + h) * dv;
      for (int64_t e = 0; e < dv; e++) {
        if (is_bf16)
          ((uint16_t *)out)[base + e] = f32_to_bf16(o[e]);
        else
          ((float *)out)[base + e] = o[e];
      }
    }
  }
}

int gated_delta_decode(const void *qkv, int64_t qkv_stride, const void *a, const void *b, const float *conv_w,
                       const float *A_log, const float *dt_bias, float *conv_state, float *rec_state,
                       const int64_t *slots, const uint8_t *has_initial, int64_t n, int64_t num_slots, int64_t hk,
                       int64_t hv, int64_t dk, int64_t dv, int64_t kernel, float *scratch, void *out, int is_bf16,
                       int threads) {
  if (dk < 1 || dv < 1 || dk > GD_MAX_DIM || dv > GD_MAX_DIM || kernel < 2 || kernel > GD_MAX_KERNEL || hk < 1 ||
      hv < hk || hv % hk)
    return -1;
  for (int64_t i = 0; i < n; i++)
    if (slots[i] < 0 || slots[i] >= num_slots) return -1;
  const int64_t conv_dim = 2 * hk * dk + hv * dv;
  if (threads < 1) threads = 1;
  conv_phase(qkv, qkv_stride, conv_w, conv_state, slots, has_initial, n, conv_dim, kernel, scratch, is_bf16,
             threads);
  delta_phase(scratch, a, b, A_log, dt_bias, rec_state, slots, has_initial, n, conv_dim, hk, hv, dk, dv, out,
              is_bf16, threads);
  return 0;
}
