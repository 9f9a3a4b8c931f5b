"""Qwen3.5's decoder (atlas_vlm.models.qwen3_5) loaded by our loader from a tiny random
``Qwen3_5ForConditionalGeneration`` checkpoint, run over the paged KV cache + state cache,
against HF transformers' forward over the whole sequence (fp32, within 1e-4)."""

from __future__ import annotations

import pytest
import torch

from atlas_vlm.loader import load_model
from qwen3_5_helpers import StepDriver, VOCAB, build_tiny_qwen3_5

pytestmark = pytest.mark.text

TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, HF model, our model)."""
    folder = tmp_path_factory.mktemp("qwen3_5")
    hf = build_tiny_qwen3_5(folder)
    return folder, hf, load_model(folder).model


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """HF's logits ``[len(ids), vocab]`` over the whole sequence."""
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).logits[0].float()


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    err = (ours - ref).abs().max().item()
    assert err < TOL, f"{what}: max logit error {err:.2e} (logit scale {ref.abs().max().item():.2f})"


@pytest.mark.parametrize("backend", ["reference", "bucketed", "decode_kernel"])
def test_prefill_then_decode_matches_hf(tiny, backend):
    _, hf, model = tiny
    ids = tokens(19, seed=1)
    ref = hf_logits(hf, ids)
    run = StepDriver(model, backend=backend)
    run.add("a")
    assert_close(run.step({"a": ids[:11]})["a"], ref[:11], "prefill")
    for t in range(11, 19):
        assert_close(run.step({"a": [ids[t]]})["a"][0], ref[t], f"decode at {t}")


def test_chunked_prefill_carries_state(tiny):
    _, hf, model = tiny
    ids = tokens(80, seed=2)  # longer than HF's 64-token chunk of the delta rule
    ref = hf_logits(hf, ids)
    run = StepDriver(model)
    run.add("a")
    start = 0
    for size in (30, 35, 15):
        out = run.step({"a": ids[start:start + size]})["a"]
        assert_close(out, ref[start:start + size], f"chunk at {start}")
        start += size


def test_two_sequences_in_one_batch(tiny):
    _, hf, model = tiny
    a, b = tokens(13, seed=3), tokens(6, seed=4)
    ref_a, ref_b = hf_logits(hf, a), hf_logits(hf, b)
    run = StepDriver(model, backend="decode_kernel")
    run.add("b")  # b takes slot 0, a slot 1: state slots need not follow the batch order
    run.add("a")
    out = run.step({"a": a[:9], "b": b[:2]})
    assert_close(out["a"], ref_a[:9], "prefill a")
    assert_close(out["b"], ref_b[:2], "prefill b")
    for i in range(4):
        out = run.step({"a": [a[9 + i]], "b": [b[2 + i]]})
        assert_close(out["a"][0], ref_a[9 + i], f"decode a {i}")
        assert_close(out["b"][0], ref_b[2 + i], f"decode b {i}")


def test_greedy_equals_hf_generate(tiny):
    _, hf, model = tiny
    prompt = tokens(7, seed=5)
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    run = StepDriver(model)
    run.add("a")
    logits = run.step({"a": prompt})["a"][-1]
    got = []
    for _ in range(10):
        got.append(int(logits.argmax()))
        logits = run.step({"a": [got[-1]]})["a"][0]
    assert got == expected


def test_text_only_checkpoint_matches_hf(tmp_path):
    """A ``Qwen3_5ForCausalLM`` checkpoint (``model.layers.*`` names, ``qwen3_5_text`` config)."""
    hf = build_tiny_qwen3_5(tmp_path / "m", seed=7, text_only=True)
    model = load_model(tmp_path / "m").model
    ids = tokens(12, seed=8)
    ref = hf_logits(hf, ids)
    run = StepDriver(model)
    run.add("a")
    assert_close(run.step({"a": ids[:9]})["a"], ref[:9], "prefill")
    for t in range(9, 12):
        assert_close(run.step({"a": [ids[t]]})["a"][0], ref[t], f"decode at {t}")


def test_mixed_step_prefill_beside_decode_and_one_token_prompt(tiny):
    """One step holding a decoding sequence, a prefill chunk and a one-token prompt (a fresh
    sequence in the decode batch: its state starts at zero whatever its slot held)."""
    _, hf, model = tiny
    a, b, c = tokens(10, seed=9), tokens(7, seed=10), tokens(3, seed=11)
    refs = {"a": hf_logits(hf, a), "b": hf_logits(hf, b), "c": hf_logits(hf, c)}
    run = StepDriver(model)
    for name in ("a", "b", "c"):
        run.add(name)
    run.state.conv.fill_(1.0)  # stale state a fresh sequence must not read
    run.state.recurrent.fill_(1.0)
    out = run.step({"a": a[:6]})
    assert_close(out["a"], refs["a"][:6], "prefill a")
    out = run.step({"a": [a[6]], "b": b[:5], "c": c[:1]})
    assert_close(out["a"][0], refs["a"][6], "decode a")
    assert_close(out["b"], refs["b"][:5], "prefill b")
    assert_close(out["c"][0], refs["c"][0], "one-token prompt c")
    out = run.step({"c": [c[1]], "a": [a[7]], "b": [b[5]]})
    for name, seq, t in (("a", a, 7), ("b", b, 5), ("c", c, 1)):
        assert_close(out[name][0], refs[name][t], f"decode {name}")


def test_cache_free_full_prefill_and_missing_state(tiny):
    """Without caches a full prefill still matches HF; a continuing sequence without
    ``meta.state`` is refused by name."""
    from atlas_vlm.layers.attention import build_attention_metadata

    _, hf, model = tiny
    ids = tokens(9, seed=12)
    meta = build_attention_metadata([9], [9], list(range(9)), [[0]])
    with torch.no_grad():
        out = model.compute_logits(model(model.embed(torch.tensor(ids)), torch.arange(9), None, meta))
    assert_close(out, hf_logits(hf, ids), "cache-free prefill")
    meta = build_attention_metadata([1], [9], [8], [[1, 2, 3]])
    with pytest.raises(ValueError, match="meta.state"):
        model(model.embed(torch.tensor(ids[:1])), torch.tensor([8]), None, meta)
