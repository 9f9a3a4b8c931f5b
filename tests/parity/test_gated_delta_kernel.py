"""The C Gated DeltaNet decode kernel (``atlas_vlm.kernels.gated_delta.decode_step``) against
its PyTorch reference (``decode_step_reference``: HF's recurrent rule): outputs and the state
written back into each sequence's slot (fp32 within 1e-5, bf16 within two bf16 steps of the
output's scale), several batch sizes, slots out of order among untouched ones, fresh
sequences over stale slots, value heads a multiple of key heads; bad inputs refused by name;
a tiny Qwen3.5's decode logits equal with the kernel and with it faked absent. (Without a C
compiler ``decode_step`` is its reference, and the first test checks that fallback.)"""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch

from atlas_vlm.kernels import gated_delta

from qwen3_5_helpers import VOCAB, StepDriver, tiny_config

pytestmark = pytest.mark.text
HAS_COMPILER = shutil.which(os.environ.get("CC") or "cc") is not None or shutil.which("gcc") is not None
NUM_SLOTS = 12


def test_builds_where_a_compiler_is_and_refuses_what_it_cannot_serve():
    assert gated_delta.available() == HAS_COMPILER
    assert "CPU only" in gated_delta.unsupported_reason("cuda", torch.float32, 2, 4, 64, 64, 4)
    assert "float32 or bfloat16" in gated_delta.unsupported_reason("cpu", torch.float16, 2, 4, 64, 64, 4)
    assert "multiple of num_k_heads" in gated_delta.unsupported_reason("cpu", torch.float32, 3, 4, 64, 64, 4)
    assert "head dims <= 256" in gated_delta.unsupported_reason("cpu", torch.float32, 2, 4, 512, 64, 4)


def random_inputs(n: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, seed: int, kernel: int = 4):
    """Arguments of ``decode_step`` (states random everywhere, so a stale slot shows) and the
    slots as a list; slots are a random subset of the cache in random order."""
    g = torch.Generator().manual_seed(seed)
    conv_dim = 2 * hk * dk + hv * dv
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    args = dict(qkv=r(n, conv_dim).to(dtype), b=r(n, hv).to(dtype), a=r(n, hv).to(dtype),
                conv_weight=(r(conv_dim, 1, kernel) * 0.6).to(dtype), A_log=(r(hv) * 0.5).to(dtype),
                dt_bias=r(hv).to(dtype), conv_state=r(NUM_SLOTS, conv_dim, kernel - 1).to(dtype).float(),
                recurrent_state=r(NUM_SLOTS, hv, dk, dv) * 0.3,
                slots=torch.randperm(NUM_SLOTS, generator=g)[:n],
                has_initial_state=torch.rand(n, generator=g) > 0.3)
    return args, dict(num_k_heads=hk, head_k_dim=dk, head_v_dim=dv)


def bound(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """fp32: 1e-5 (relative above magnitude 1); bf16: two bf16 steps (2 * 2^-8) of the largest magnitude."""
    scale = ref.abs().max().item()
    return 1e-5 * max(1.0, scale) if dtype == torch.float32 else 2 * 2.0**-8 * max(scale, 1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, hk, hv, dk, dv", [(1, 2, 4, 16, 32), (5, 2, 4, 16, 32), (8, 1, 4, 32, 16),
                                               (3, 2, 2, 64, 64), (12, 4, 8, 64, 64)])
def test_kernel_equals_pytorch_reference_over_steps(dtype, n, hk, hv, dk, dv):
    args, sizes = random_inputs(n, hk, hv, dk, dv, dtype, seed=n * 7 + hv)
    ref_args = {k: v.clone() for k, v in args.items()}
    before = {k: args[k].clone() for k in ("conv_state", "recurrent_state")}
    for step in range(3):  # the states carry from step to step; later steps continue every sequence
        if step:
            fresh_qkv = torch.randn(args["qkv"].shape, generator=torch.Generator().manual_seed(step)).to(dtype)
            for d in (args, ref_args):
                d["qkv"], d["has_initial_state"] = fresh_qkv, torch.ones(n, dtype=torch.bool)
        out = gated_delta.decode_step(**args, **sizes)
        ref = gated_delta.decode_step_reference(**ref_args, **sizes)
        assert out.shape == ref.shape == (n, hv, dv) and out.dtype == ref.dtype == dtype
        err = (out.float() - ref.float()).abs().max().item()
        assert err <= bound(ref.float(), dtype), f"step {step}: output error {err:.2e}"
        for name in ("conv_state", "recurrent_state"):
            err = (args[name] - ref_args[name]).abs().max().item()
            assert err <= bound(ref_args[name], dtype), f"step {step}: {name} error {err:.2e}"
    untouched = sorted(set(range(NUM_SLOTS)) - set(args["slots"].tolist()))
    for name in ("conv_state", "recurrent_state"):
        assert torch.equal(args[name][untouched], before[name][untouched]), f"{name}: a slot outside the batch changed"
        assert not torch.equal(args[name][args["slots"]], before[name][args["slots"]])


def test_fresh_sequence_ignores_its_stale_slot():
    """A sequence with has_initial_state False gives the same output whatever its slot held."""
    args, sizes = random_inputs(4, 2, 4, 16, 32, torch.float32, seed=3)
    args["has_initial_state"] = torch.tensor([False, True, False, True])
    other = {k: v.clone() for k, v in args.items()}
    fresh = args["slots"][[0, 2]]
    other["conv_state"][fresh] = 0.0
    other["recurrent_state"][fresh] = 5.0
    out, out2 = gated_delta.decode_step(**args, **sizes), gated_delta.decode_step(**other, **sizes)
    assert torch.equal(out, out2)
    assert torch.equal(args["recurrent_state"][fresh], other["recurrent_state"][fresh])


def test_state_the_kernel_cannot_write_through_goes_the_pytorch_way():
    """A non-contiguous recurrent state (a transposed view) is updated in place by the PyTorch path."""
    args, sizes = random_inputs(3, 2, 4, 16, 16, torch.float32, seed=6)
    args["recurrent_state"] = args["recurrent_state"].transpose(-1, -2).contiguous().transpose(-1, -2)
    ref_args = {k: v.clone() for k, v in args.items()}
    out = gated_delta.decode_step(**args, **sizes)
    assert not args["recurrent_state"].is_contiguous()
    assert torch.equal(out, gated_delta.decode_step_reference(**ref_args, **sizes))
    assert torch.equal(args["recurrent_state"], ref_args["recurrent_state"])


@pytest.mark.parametrize("change, match", [
    (lambda a: a.update(slots=torch.tensor([3, 3, 1])), "slots"),
    (lambda a: a.update(slots=torch.tensor([0, 1, NUM_SLOTS])), "slots"),
    (lambda a: a.update(qkv=a["qkv"][:, :-1]), "qkv"),
    (lambda a: a.update(b=a["b"][:2]), "b has shape"),
    (lambda a: a.update(recurrent_state=a["recurrent_state"][:-1]), "conv_state has 12 slots"),
])
def test_bad_input_is_refused_by_name(change, match):
    args, sizes = random_inputs(3, 2, 4, 16, 32, torch.float32, seed=5)
    change(args)
    for fn in (gated_delta.decode_step, gated_delta.decode_step_reference):
        with pytest.raises(ValueError, match=match):
            fn(**args, **sizes)


def tiny_model(dtype: torch.dtype):
    """Our Qwen3.5 decoder on the tests' tiny config (3 Gated DeltaNet layers, 2 key / 4 value
    heads), random weights (nothing saved or loaded: both runs share them)."""
    from atlas_vlm.models.arch import ModelArch
    from atlas_vlm.models.qwen3_5.model import Qwen3_5ForCausalLM

    config = tiny_config().text_config
    config.architectures = ["Qwen3_5ForCausalLM"]
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(ModelArch.from_hf_config(config), config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.5 if p.dim() < 2 else 0.2))
    return model.to(dtype)


def decode_logits(model, monkeypatch, kernel: bool) -> tuple[list[torch.Tensor], int]:
    """Two sequences (slots out of batch order, different lengths) prefilled then decoded 5
    steps; returns each step's logits and how many decode batches reached the C kernel."""
    calls = []
    real = gated_delta.decode_step
    with monkeypatch.context() as m:
        if not kernel:
            m.setattr(gated_delta, "available", lambda: False)
        m.setattr(gated_delta, "decode_step", lambda *a, **k: calls.append(1) or real(*a, **k))
        run = StepDriver(model)
        run.add("b")
        run.add("a")
        g = torch.Generator().manual_seed(4)
        ids = {"a": torch.randint(0, VOCAB, (14,), generator=g).tolist(),
               "b": torch.randint(0, VOCAB, (9,), generator=g).tolist()}
        logits = [torch.cat(list(run.step({"a": ids["a"][:9], "b": ids["b"][:4]}).values()))]
        for t in range(5):
            logits.append(torch.cat(list(run.step({"a": [ids["a"][9 + t]], "b": [ids["b"][4 + t]]}).values())))
    return logits, len(calls)


def test_tiny_model_decode_logits_equal_with_and_without_kernel(monkeypatch):
    model = tiny_model(torch.float32)
    with_kernel, calls = decode_logits(model, monkeypatch, kernel=True)
    without, calls_without = decode_logits(model, monkeypatch, kernel=False)
    # 5 decode steps x 3 Gated DeltaNet layers (none without a compiler: the PyTorch path both times)
    assert calls == (5 * 3 if HAS_COMPILER else 0) and calls_without == 0
    for step, (ours, ref) in enumerate(zip(with_kernel, without)):
        err = (ours - ref).abs().max().item()
        assert err <= bound(ref, torch.float32), f"step {step}: logit error {err:.2e}"


def test_tiny_bf16_model_kernel_differs_less_than_bf16_itself(monkeypatch):
    """bf16: a rounding that flips in one layer grows through the next ones, so the logits are
    compared at the bf16 model's own accuracy: with the kernel they differ from those without
    it by no more than those differ from the same weights run in fp32."""
    model = tiny_model(torch.bfloat16)
    with_kernel, calls = decode_logits(model, monkeypatch, kernel=True)
    without, _ = decode_logits(model, monkeypatch, kernel=False)
    fp32, _ = decode_logits(copy.deepcopy(model).float(), monkeypatch, kernel=False)
    assert calls == (5 * 3 if HAS_COMPILER else 0)
    for step, (ours, ref, exact) in enumerate(zip(with_kernel, without, fp32)):
        err, own = (ours - ref).abs().max().item(), (ref - exact).abs().max().item()
        assert err <= own, f"step {step}: kernel changes bf16 logits by {err:.2e}, bf16 itself errs by {own:.2e}"
