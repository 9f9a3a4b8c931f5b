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

import builtins

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

from conftest import DEVICE
from atlas_vlm.kernels import triton_gated_delta, triton_gated_delta_chunk
from atlas_vlm.kernels.gated_delta import decode_step_reference
from atlas_vlm.kernels.gated_delta_backend import use_triton
from atlas_vlm.kernels.triton_gated_delta import decode_rows
from atlas_vlm.kernels.triton_gated_delta_chunk import chunk_gated_delta_rule
from atlas_vlm.loader import load_model
from atlas_vlm.models.qwen3_5.gated_deltanet import GatedDeltaNet
from qwen3_5_helpers import VOCAB, StepDriver, build_tiny_qwen3_5

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


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("q35_triton") / "text"
    build_tiny_qwen3_5(folder, text_only=True)
    return load_model(folder).model


def set_rule_backend(model, backend: str) -> None:
    for m in model.modules():
        if isinstance(m, GatedDeltaNet):
            m.rule_backend = backend


def state_of(run: StepDriver, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    slot = run.seqs[name]["slot"]
    return run.state.conv[:, slot].clone(), run.state.recurrent[:, slot].clone()


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.skipif(DEVICE != "cpu", reason="the tiny model's step driver runs on CPU tensors")
def test_a_tiny_qwen3_5_forced_to_triton_steps_as_pytorch_and_rolls_back(model, monkeypatch):
    """Prefill (two sequences), a decode batch, then a verification of 3 drafts beside a plain
    decode: logits and states as the PyTorch path's; accepting 1 of the 3 drafts leaves the
    state of decoding those 2 tokens."""
    calls = {"decode": 0, "chunk": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(triton_gated_delta, "decode_step", counted("decode", triton_gated_delta.decode_step))
    monkeypatch.setattr(triton_gated_delta_chunk, "chunk_gated_delta_rule",
                        counted("chunk", triton_gated_delta_chunk.chunk_gated_delta_rule))
    steps = [({"a": ids(9, 1), "b": ids(5, 2)}, None), ({"a": ids(1, 3), "b": ids(1, 4)}, None),
             ({"a": ids(4, 5), "b": ids(1, 6)}, {"a": 3})]
    runs = {}
    try:
        for backend in ("torch", "triton"):
            set_rule_backend(model, backend)
            run = runs[backend] = StepDriver(model)
            run.add("a")
            run.add("b")
            run.logits = [run.step(new, drafts=drafts) for new, drafts in steps]
            run.state.accept_rows(run.seqs["a"]["slot"], 2)  # the last sampled token and 1 draft taken
        set_rule_backend(model, "torch")
        decoded = StepDriver(model)  # the same tokens, the 2 taken rows decoded one by one (PyTorch: cheaper)
        decoded.add("a")
        for new in (steps[0][0]["a"], steps[1][0]["a"], *[[t] for t in steps[2][0]["a"][:2]]):
            decoded.step({"a": new})
    finally:
        set_rule_backend(model, "auto")
    assert calls["decode"] > 0 and calls["chunk"] > 0, f"the Triton path did not run: {calls}"
    for step, (want, ours) in enumerate(zip(runs["torch"].logits, runs["triton"].logits)):
        for name in want:
            assert (ours[name] - want[name]).abs().max().item() < 1e-4, f"step {step}, sequence {name}"
    for name in ("a", "b"):
        for ours, want in zip(state_of(runs["triton"], name), state_of(runs["torch"], name)):
            close(ours, want, torch.float32, f"state of {name}")
    for ours, want in zip(state_of(runs["triton"], "a"), state_of(decoded, "a")):
        close(ours, want, torch.float32, "state after accepting 1 of 3 drafts")


def test_auto_picks_triton_on_cuda_only():
    assert use_triton("auto", "cuda", torch.bfloat16, 128, 128)
    assert use_triton("auto", torch.device("cuda", 1), torch.float32, 16, 16)
    assert not use_triton("torch", "cuda", torch.bfloat16, 128, 128)
    assert not use_triton("auto", "cpu", torch.float32, 16, 16)  # CPU: the C kernel / PyTorch, as before
    # a step whose attention runs the "triton" backend: Triton here too where it serves (the interpreter on CPU)
    assert use_triton("auto", "cpu", torch.float32, 16, 16, triton_step=True) == triton_gated_delta.interpreting()
    assert not use_triton("auto", "cuda", torch.int8, 16, 16)


def test_forced_triton_says_why_it_cannot_serve(monkeypatch):
    with pytest.raises(ValueError, match="rule_backend must be one of"):
        use_triton("fla", "cuda", torch.float32, 16, 16)
    with pytest.raises(ValueError, match="head dims 16 / 512"):
        use_triton("triton", "cuda", torch.float32, 16, 512)
    monkeypatch.setattr(triton_gated_delta, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        use_triton("triton", "cpu", torch.float32, 16, 16)
    real_import = builtins.__import__

    def no_triton(name, *args, **kwargs):
        if name == "atlas_vlm.kernels" and "triton_gated_delta" in (args[2] or ()):
            raise ImportError("No module named 'triton'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_triton)
    assert not use_triton("auto", "cuda", torch.float32, 16, 16)
    with pytest.raises(ValueError, match="triton does not import"):
        use_triton("triton", "cuda", torch.float32, 16, 16)


def test_bad_inputs_are_named():
    args, (conv, rec), slots = decode_inputs(2, 2, (1, 1), 16, 16, 4, torch.float32, 0)
    init = torch.ones(2, dtype=torch.bool)
    with pytest.raises(ValueError, match="keep must be"):
        decode_rows(**args, conv_state=conv, recurrent_state=rec, slots=slots, has_initial_state=init, num_k_heads=1,
                    head_k_dim=16, head_v_dim=16, keep=(conv, rec))
    with pytest.raises(ValueError, match="recurrent_state must be contiguous fp32"):
        decode_rows(**args, conv_state=conv, recurrent_state=rec.double(), slots=slots, has_initial_state=init,
                    num_k_heads=1, head_k_dim=16, head_v_dim=16)
    q = torch.zeros(1, 3, 1, 16)
    with pytest.raises(ValueError, match="chunk_size must be 16, 32 or 64"):
        chunk_gated_delta_rule(q, q, q, torch.zeros(1, 3, 1), torch.zeros(1, 3, 1), chunk_size=128)
    with pytest.raises(ValueError, match="g \\(1, 2, 1\\)"):
        chunk_gated_delta_rule(q, q, q, torch.zeros(1, 2, 1), torch.zeros(1, 3, 1))
