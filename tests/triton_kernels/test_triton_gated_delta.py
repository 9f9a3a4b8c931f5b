"""Qwen3.5's Gated DeltaNet in Triton against its PyTorch references: the decode rows
(``triton_gated_delta.decode_rows`` against ``gated_delta.decode_step_reference`` run row by
row, the kept per-row states included) and the chunked prefill rule
(``triton_gated_delta_chunk.chunk_gated_delta_rule`` against HF's
``torch_chunk_gated_delta_rule``): hypothesis over lengths across chunk boundaries and tails,
heads (GQA), head dims 16 / 32, zero or random initial states; fp32 to 1e-4 relative, bf16
looser (the interpreter rounds to bf16 by truncation, GPUs to nearest). Then the rollback
(accepting ``j`` of ``k`` drafts leaves the state of ``j + 1`` tokens), a tiny Qwen3.5 run
step by step with the layers forced to Triton against PyTorch, and the selection with the
device faked. Small shapes, few examples: the interpreter runs every program in numpy."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

from conftest import DEVICE
from atlas_vlm.kernels import gated_delta
from atlas_vlm.kernels.gated_delta import decode_step_reference
from atlas_vlm.kernels.triton_gated_delta import decode_rows
from atlas_vlm.kernels.triton_gated_delta_chunk import chunk_gated_delta_rule

pytestmark = [pytest.mark.text, pytest.mark.triton]

RTOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
FEW = settings(max_examples=10, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
HEADS = st.sampled_from([(1, 1), (1, 2), (2, 2)])  # (num_k_heads, num_v_heads)


def close(ours: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    err = (ours.float() - want.float()).abs().max().item() / max(want.float().abs().max().item(), 1e-6)
    assert err < RTOL[dtype], f"{what}: relative error {err:.2e}"


def decode_inputs(n, rows, heads, dk, dv, kernel, dtype, seed, num_slots=5):
    """Random decode inputs and fp32 state slots (the first ``n`` slots in reverse order)."""
    g = torch.Generator().manual_seed(seed)
    hk, hv = heads
    conv_dim = 2 * hk * dk + hv * dv
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    args = dict(qkv=r(n, rows, conv_dim).to(dtype), b=r(n, rows, hv).to(dtype), a=r(n, rows, hv).to(dtype),
                conv_weight=(0.5 * r(conv_dim, 1, kernel)).to(dtype), A_log=r(hv), dt_bias=r(hv))
    states = (r(num_slots, conv_dim, kernel - 1), r(num_slots, hv, dk, dv))
    slots = torch.arange(n - 1, -1, -1)
    return args, states, slots


def reference_rows(args, states, slots, init, hk, dk, dv):
    """``decode_step_reference`` row after row: outputs ``[n, T, hv, dv]`` and the states after each row."""
    conv, rec = (t.clone() for t in states)
    outs, after = [], []
    for t in range(args["qkv"].shape[1]):
        row = {k: (v[:, t] if k in ("qkv", "b", "a") else v) for k, v in args.items()}
        outs.append(decode_step_reference(**row, conv_state=conv, recurrent_state=rec, slots=slots,
                                          has_initial_state=init, num_k_heads=hk, head_k_dim=dk, head_v_dim=dv))
        after.append((conv[slots].clone(), rec[slots].clone()))
        init = torch.ones_like(init)
    return torch.stack(outs, 1), after


@FEW
@given(n=st.integers(1, 3), rows=st.integers(1, 3), heads=HEADS, dk=st.sampled_from([16, 32]),
       dv=st.sampled_from([16, 32]), kernel=st.integers(2, 4), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       fresh=st.booleans(), seed=st.integers(0, 99))
def test_decode_rows_match_the_reference_row_by_row(n, rows, heads, dk, dv, kernel, dtype, fresh, seed):
    args, states, slots = decode_inputs(n, rows, heads, dk, dv, kernel, dtype, seed)
    init = torch.tensor([not (fresh and i == 0) for i in range(n)])  # sequence 0 may start from zero
    want, after = reference_rows(args, states, slots, init, heads[0], dk, dv)
    conv, rec = (t.clone().to(DEVICE) for t in states)
    keep = (torch.zeros(n, rows - 1, *conv.shape[1:], device=DEVICE), torch.zeros(n, rows - 1, *rec.shape[1:],
                                                                                device=DEVICE))
    dev = {k: v.to(DEVICE) for k, v in args.items()}
    out = decode_rows(**dev, conv_state=conv, recurrent_state=rec, slots=slots.to(DEVICE),
                      has_initial_state=init.to(DEVICE), num_k_heads=heads[0], head_k_dim=dk, head_v_dim=dv,
                      keep=keep if rows > 1 else None)
    close(out.cpu(), want, dtype, "outputs")
    close(conv[slots].cpu(), after[-1][0], dtype, "conv state")
    close(rec[slots].cpu(), after[-1][1], dtype, "recurrent state")
    for t in range(rows - 1):  # the kept rows: StateCache's rows of a verification step
        close(keep[0][:, t].cpu(), after[t][0], dtype, f"kept conv state after row {t}")
        close(keep[1][:, t].cpu(), after[t][1], dtype, f"kept recurrent state after row {t}")
    untouched = torch.arange(n, conv.shape[0])
    assert torch.equal(rec[untouched].cpu(), states[1][untouched]), "another slot's state changed"


@FEW
@given(length=st.integers(1, 70), chunk=st.sampled_from([16, 32]), heads=HEADS, dk=st.sampled_from([16, 32]),
       dv=st.sampled_from([16, 32]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       initial=st.booleans(), seed=st.integers(0, 99))
def test_chunk_rule_matches_hf_torch_chunk_rule(length, chunk, heads, dk, dv, dtype, initial, seed):
    check_chunk_rule(length, chunk, heads, dk, dv, dtype, initial, seed)


@pytest.mark.parametrize("length", [64, 65])
def test_chunk_rule_at_chunk_64_across_its_boundary(length):
    check_chunk_rule(length, 64, (1, 2), 16, 16, torch.float32, True, length)


def check_chunk_rule(length, chunk, heads, dk, dv, dtype, initial, seed):
    g = torch.Generator().manual_seed(seed)
    (hk, hv), r = heads, lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, k, v = r(1, length, hk, dk).to(dtype), r(1, length, hk, dk).to(dtype), r(1, length, hv, dv).to(dtype)
    decay = -torch.rand(1, length, hv, generator=g)  # log decays <= 0
    beta = torch.rand(1, length, hv, generator=g).to(dtype)
    h0 = r(1, hv, dk, dv) if initial else None
    want, want_final = torch_chunk_gated_delta_rule(q, k, v, decay, beta, initial_state=h0, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
    out, final = chunk_gated_delta_rule(*(t.to(DEVICE) for t in (q, k, v, decay, beta)), chunk_size=chunk,
                                        initial_state=None if h0 is None else h0.to(DEVICE),
                                        output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert out.dtype == dtype and final.dtype == torch.float32
    close(out.cpu(), want, dtype, f"outputs of {length} tokens")
    close(final.cpu(), want_final, dtype, f"final state after {length} tokens")
