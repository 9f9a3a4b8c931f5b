"""bf16 on CPU, checked on its own (fp32 stays the exactness reference elsewhere): the
embedded SmolLM2-135M-Instruct in bf16 against HF ``transformers`` in bf16 on the same
converted weights, over the real-weights prompts (``test_real_weights.PROMPTS``).

bf16 rounds differently in our fused QKV / gate-up GEMMs than in HF's separate ones, so
tokens may part where two logits nearly tie; the bounds below sit well under the measured
figures yet far above what a broken kernel (wrong mask, wrong cast, wrong RoPE) reaches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from test_real_weights import NEW_TOKENS, PROMPTS
from atlas_vlm import LLM, SamplingParams
from atlas_vlm.default_models import default_text_model
from atlas_vlm.layers.attention import build_attention_metadata
from atlas_vlm.loader import gguf_to_folder

pytestmark = pytest.mark.text

MIN_TOP1_AGREEMENT = 0.9  # measured 160 / 160 = 1.00 (torch 2.14.1, AVX512-BF16 CPU, 2026-11-30)
TIE_MARGIN = 0.25  # bf16 logits: where greedy decodes part, HF's top-1 leads our token by at most this
# (4 bf16 ulps at logits ~8; measured 0.094 at the one parting seen)


@pytest.fixture(scope="module")
def hf_bf16():
    """(tokenizer, HF model in bf16, per prompt: (prompt ids, HF greedy continuation))."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = gguf_to_folder(Path(default_text_model()))
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    runs = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = tok(p, return_tensors="pt")["input_ids"]  # [1, n]
            gen = model.generate(input_ids=ids, do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None,
                                 pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0)
            runs.append((ids[0].tolist(), gen[0, ids.shape[1]:].tolist()))
    return tok, model, runs


@pytest.fixture(scope="module")
def llm_bf16():
    return LLM(max_model_len=128, kv_cache_memory=64 << 20, dtype="bfloat16", device="cpu")


def test_engine_runs_in_bf16(llm_bf16):
    model = llm_bf16.engine.runner.model
    assert model.model.norm.weight.dtype == torch.bfloat16 and llm_bf16.engine.runner.dtype == torch.bfloat16
    assert model.model.embed_tokens(torch.tensor([1, 2])).dtype == torch.bfloat16  # the GGUF's table as stored
    assert llm_bf16.engine.runner.kv_cache.k_cache.dtype == torch.bfloat16


def test_teacher_forced_top1_agrees_with_hf_bf16(hf_bf16, llm_bf16):
    """Both models read prompt + HF's greedy continuation; the argmax at every continuation
    position agrees in >= 90% of the 160 positions (measured 100%)."""
    _, hf, runs = hf_bf16
    model = llm_bf16.engine.runner.model
    agree = total = 0
    with torch.no_grad():
        for prompt_ids, cont in runs:
            seq = prompt_ids + cont
            n, m = len(prompt_ids), len(seq)
            ref = hf(torch.tensor([seq])).logits[0, n - 1:m - 1].float().argmax(-1)  # [NEW_TOKENS]
            meta = build_attention_metadata([m], [m], list(range(m)), [[0]])
            hidden = model(model.embed(torch.tensor(seq)), torch.arange(m), None, meta)  # [m, hidden]
            ours = model.compute_logits(hidden)[n - 1:m - 1].argmax(-1)  # [NEW_TOKENS]
            agree += int((ours == ref).sum())
            total += len(ref)
    assert total == len(PROMPTS) * NEW_TOKENS
    assert agree / total >= MIN_TOP1_AGREEMENT, f"top-1 agreement {agree}/{total}"


def test_greedy_tokens_follow_hf_bf16(hf_bf16, llm_bf16):
    """The engine's own greedy decode (paged KV, batched) follows HF bf16 ``generate`` token for
    token until the two part, and they part only at a near-tie: where HF's own logits (teacher
    forced on the common prefix) put our token within ``TIE_MARGIN`` of its top-1 and in its
    top 2. Measured: 4 of 5 prompts equal for all 32 tokens, one parting at token 5 where HF's
    top two logits are 7.50 / 7.41 (Intel AMX CPU, 2026-12-02; on the AVX512-BF16 CPU common
    prefixes were 24-32 of 32); 3 of 5 parted, each at a near-tie, on an Intel Xeon without
    AVX512-BF16 with ATen / oneDNN capped to AVX2 (.ci/run's second pass, 2026-12-07): how many
    part depends on the CPU's bf16 GEMM, where they part does not."""
    _, hf, runs = hf_bf16
    outs = llm_bf16.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                             use_tqdm=False)
    parted = 0
    for out, (prompt_ids, cont) in zip(outs, runs, strict=True):
        assert out.prompt_token_ids == prompt_ids
        assert len(out.token_ids) == NEW_TOKENS
        j = next((i for i, (a, b) in enumerate(zip(out.token_ids, cont)) if a != b), None)
        if j is None:
            continue
        parted += 1
        with torch.no_grad():
            logits = hf(torch.tensor([prompt_ids + cont[:j]])).logits[0, -1].float()  # [vocab]
        ours = out.token_ids[j]
        assert ours in logits.topk(2).indices.tolist(), (out.prompt, j)
        assert float(logits.max() - logits[ours]) <= TIE_MARGIN, (out.prompt, j, float(logits.max() - logits[ours]))
    assert parted < len(PROMPTS)  # some prompt agrees for all 32 tokens; every parting is at a near-tie (above)
