"""Stage 1: base correctness against Hugging Face ``transformers`` on the same weights.

Tiny random Qwen2, Llama and Qwen3 (q/k norm, explicit head_dim) models (``tiny_models`` fixture) are loaded through our real
loader; one-token prefill, one decode step and a longer prefill must give HF's logits
within atol 1e-4 (fp32, CPU), and every loaded parameter must equal HF's.
"""

from __future__ import annotations

import pytest
import torch

from helpers import StepRecorder
from atlas_vlm import LLM, SamplingParams

pytestmark = pytest.mark.text

FAMILIES = ("qwen2", "llama", "qwen3")
TIED = ("llama", "qwen3")  # tie_word_embeddings in the tiny configs


def greedy(llm: LLM, prompt_ids: list[int], max_tokens: int):
    """(generated ids, [max_tokens, vocab] logits of every step) of one greedy request."""
    with StepRecorder(llm) as rec:
        out = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                           use_tqdm=False)[0]
    return out.token_ids, torch.stack(rec.logits[out.request_id])


@pytest.fixture(scope="module")
def engines(tiny_models):
    return {fam: LLM(str(tiny_models[fam][0]), kv_cache="paged", max_model_len=512, num_kvcache_blocks=16, dtype="float32")
            for fam in FAMILIES}


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 150000, (n,), generator=g).tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_one_token_prefill_and_one_decode_step_match_hf(family, engines, tiny_models):
    hf = tiny_models[family][1]
    ids = prompt(1, seed=1)
    tokens, logits = greedy(engines[family], ids, max_tokens=2)
    assert logits.shape == (2, hf.config.vocab_size)
    with torch.no_grad():
        hf_prefill = hf(torch.tensor([ids]))
        ref0 = hf_prefill.logits[0, -1].float()
        torch.testing.assert_close(logits[0], ref0, atol=1e-4, rtol=0)
        assert tokens[0] == int(ref0.argmax())
        # decode step: HF incremental (past_key_values) and HF full forward over both tokens
        step = hf(torch.tensor([[tokens[0]]]), past_key_values=hf_prefill.past_key_values, use_cache=True)
        ref1_cached = step.logits[0, -1].float()
        ref1_full = hf(torch.tensor([ids + [tokens[0]]])).logits[0, -1].float()
    torch.testing.assert_close(logits[1], ref1_cached, atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[1], ref1_full, atol=1e-4, rtol=0)
    assert tokens[1] == int(ref1_full.argmax())
    # the logits are not trivially equal: the two steps' distributions differ clearly
    assert (logits[0] - logits[1]).abs().max() > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_long_prompt_prefill_matches_hf(family, engines, tiny_models):
    hf = tiny_models[family][1]
    ids = prompt(37, seed=2)
    tokens, logits = greedy(engines[family], ids, max_tokens=1)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1].float()
    torch.testing.assert_close(logits[0], ref, atol=1e-4, rtol=0)
    assert tokens == [int(ref.argmax())]


@pytest.mark.parametrize("family", FAMILIES)
def test_no_cache_forward_matches_hf_at_every_position(family, engines, tiny_models):
    """Our decoder without a cache (one full prefill) equals HF's hidden logits at every token."""
    from atlas_vlm.layers.attention import build_attention_metadata

    hf = tiny_models[family][1]
    model = engines[family].engine.runner.model
    ids = prompt(23, seed=3)
    n = len(ids)
    meta = build_attention_metadata([n], [n], list(range(n)), [[0]])
    with torch.no_grad():
        x = model.embed(torch.tensor(ids))
        ours = model.compute_logits(model(x, torch.arange(n), None, meta))
        ref = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_loaded_parameters_equal_hf(family, engines, tiny_models):
    hf = tiny_models[family][1]
    ours = dict(engines[family].engine.runner.model.named_parameters())
    theirs = hf.state_dict()
    cfg = hf.config
    assert torch.equal(ours["model.embed_tokens.weight"], theirs["model.embed_tokens.weight"])
    assert torch.equal(ours["model.norm.weight"], theirs["model.norm.weight"])
    lm_head = engines[family].engine.runner.model.lm_head.weight
    assert torch.equal(lm_head, theirs["lm_head.weight"])
    if family in TIED:  # tie_word_embeddings: one tensor
        assert lm_head.data_ptr() == ours["model.embed_tokens.weight"].data_ptr()
    else:
        assert lm_head.data_ptr() != ours["model.embed_tokens.weight"].data_ptr()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    for i in range(cfg.num_hidden_layers):
        p, h = f"model.layers.{i}.", f"model.layers.{i}."
        qkv = ours[p + "self_attn.qkv_proj.weight"]
        assert qkv.shape == ((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * head_dim, cfg.hidden_size)
        assert torch.equal(qkv, torch.cat([theirs[h + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
        if family == "qwen2":
            assert torch.equal(ours[p + "self_attn.qkv_proj.bias"],
                               torch.cat([theirs[h + f"self_attn.{n}_proj.bias"] for n in "qkv"]))
        else:
            assert p + "self_attn.qkv_proj.bias" not in ours
        assert torch.equal(ours[p + "self_attn.o_proj.weight"], theirs[h + "self_attn.o_proj.weight"])
        assert torch.equal(ours[p + "mlp.gate_up_proj.weight"],
                           torch.cat([theirs[h + "mlp.gate_proj.weight"], theirs[h + "mlp.up_proj.weight"]]))
        assert torch.equal(ours[p + "mlp.down_proj.weight"], theirs[h + "mlp.down_proj.weight"])
        norms = ("input_layernorm", "post_attention_layernorm")
        if family == "qwen3":
            norms += ("self_attn.q_norm", "self_attn.k_norm")
            assert ours[p + "self_attn.q_norm.weight"].shape == (head_dim,)
        for norm in norms:
            assert torch.equal(ours[p + f"{norm}.weight"], theirs[h + f"{norm}.weight"])
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | (set() if family in TIED else {"lm_head.weight"})
    per_layer = {"self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight",
                 "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"}
    if family == "qwen2":
        per_layer.add("self_attn.qkv_proj.bias")
    if family == "qwen3":
        per_layer |= {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}
    expected |= {f"model.layers.{i}.{n}" for i in range(cfg.num_hidden_layers) for n in per_layer}
    assert set(ours) == expected
