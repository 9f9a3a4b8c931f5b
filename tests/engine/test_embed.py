"""Embedding requests (``PoolingParams``, ``LLM.embed``) on a tiny random Qwen2: "last" and
"mean" pooling equal the HF model's final hidden states (after the final norm), normalisation
and Matryoshka ``dimensions`` exact, chunked prefill and prefix caching give the same vector,
and embedding requests mixed with generation leave the generations unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from atlas_vlm import LLM, PoolingParams, SamplingParams

pytestmark = pytest.mark.text

TEXTS = ["The quick brown fox jumps over the lazy dog. " * 4, "Hello", "Embeddings are vectors."]
RAW = dict(normalize=False)


def make_llm(folder, **kwargs):
    base = dict(max_model_len=512, kvcache_block_size=16, num_kvcache_blocks=64, device="cpu", dtype="float32")
    return LLM(str(folder), **{**base, **kwargs})


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models["qwen2"]


@pytest.fixture(scope="module")
def llm(tiny):
    return make_llm(tiny[0])


@torch.no_grad()
def hf_hidden(hf, ids: list[int]) -> torch.Tensor:
    """HF final hidden states (after the final norm) ``[n, hidden]`` of one prompt."""
    return hf.model(input_ids=torch.tensor([ids])).last_hidden_state[0].float()


def vec(out) -> torch.Tensor:
    assert out.error is None and out.finish_reason == "stop"
    return torch.tensor(out.embedding)


def test_last_and_mean_equal_hf_hidden_states(llm, tiny):
    hf = tiny[1]
    last = llm.embed(TEXTS, PoolingParams(**RAW), use_tqdm=False)
    mean = llm.embed(TEXTS, PoolingParams(pooling="mean", **RAW), use_tqdm=False)
    for a, b in zip(last, mean):
        ref = hf_hidden(hf, a.prompt_token_ids)
        assert a.prompt_token_ids == b.prompt_token_ids
        torch.testing.assert_close(vec(a), ref[-1], atol=1e-5, rtol=0)
        torch.testing.assert_close(vec(b), ref.mean(dim=0), atol=1e-5, rtol=0)
        assert a.token_ids == [] and a.text == ""


def test_normalize_and_dimensions_exact(llm):
    raw = vec(llm.embed(TEXTS[0], PoolingParams(**RAW), use_tqdm=False)[0])
    (normed,) = llm.embed(TEXTS[0], use_tqdm=False)  # default: last, normalised, every dimension
    assert torch.equal(vec(normed), F.normalize(raw, dim=0))
    assert abs(vec(normed).norm().item() - 1) < 1e-6
    (cut,) = llm.embed(TEXTS[0], PoolingParams(dimensions=16, **RAW), use_tqdm=False)
    assert torch.equal(vec(cut), raw[:16])
    (cut_normed,) = llm.embed(TEXTS[0], PoolingParams(dimensions=16), use_tqdm=False)
    assert torch.equal(vec(cut_normed), F.normalize(raw[:16], dim=0))  # truncated, then normalised


def test_text_and_token_id_prompts_agree(llm):
    (text,) = llm.embed(TEXTS[2], use_tqdm=False)
    (ids,) = llm.embed({"prompt_token_ids": text.prompt_token_ids}, use_tqdm=False)
    (bare,) = llm.embed(text.prompt_token_ids, use_tqdm=False)
    assert vec(ids).tolist() == vec(text).tolist() == vec(bare).tolist()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_chunked_prefill_same_vector(tiny, llm, pooling):
    params = PoolingParams(pooling=pooling, **RAW)
    whole = [vec(o) for o in llm.embed(TEXTS, params, use_tqdm=False)]
    chunked = make_llm(tiny[0], max_num_batched_tokens=8, enable_chunked_prefill=True)
    steps = []
    chunked.engine.runner.observers.append(lambda chunks, inp, logits, sampled: steps.append(len(chunks)))
    outs = chunked.embed(TEXTS, params, use_tqdm=False)
    assert len(steps) >= len(outs[0].prompt_token_ids) // 8  # the long prompt took several steps
    for a, b in zip(outs, whole):
        torch.testing.assert_close(vec(a), b, atol=1e-5, rtol=0)


def test_mean_with_prefix_caching_sees_every_token(tiny):
    cached = make_llm(tiny[0], enable_prefix_caching=True)
    params = PoolingParams(pooling="mean", **RAW)
    gen = SamplingParams(max_tokens=2, temperature=0)
    cached.generate(TEXTS[0], gen, use_tqdm=False)  # fills the prefix cache with the prompt's blocks
    (first,) = cached.embed(TEXTS[0], params, use_tqdm=False)
    (second,) = cached.embed(TEXTS[0], params, use_tqdm=False)
    ref = hf_hidden(tiny[1], first.prompt_token_ids).mean(dim=0)
    torch.testing.assert_close(vec(first), ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(vec(second), ref, atol=1e-5, rtol=0)
    (last,) = cached.embed(TEXTS[0], PoolingParams(**RAW), use_tqdm=False)  # last: a cache hit is fine
    torch.testing.assert_close(vec(last), hf_hidden(tiny[1], first.prompt_token_ids)[-1], atol=1e-5, rtol=0)


def test_mixed_with_generation_same_generations(llm):
    gen = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (6, 9)]
    alone = llm.generate(TEXTS[:2], gen, use_tqdm=False)
    emb_alone = [vec(o) for o in llm.embed(TEXTS, PoolingParams(pooling="mean", **RAW), use_tqdm=False)]
    prompts = [TEXTS[0], TEXTS[0], TEXTS[1], TEXTS[2], TEXTS[1]]
    params = [gen[0], PoolingParams(pooling="mean", **RAW), PoolingParams(pooling="mean", **RAW),
              PoolingParams(pooling="mean", **RAW), gen[1]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[0].token_ids == alone[0].token_ids and outs[4].token_ids == alone[1].token_ids
    assert outs[0].embedding is None and len(outs[0].token_ids) == 6
    for out, ref in zip(outs[1:4], emb_alone):
        assert out.token_ids == []
        torch.testing.assert_close(vec(out), ref, atol=1e-5, rtol=0)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # every block back, the embedding requests' too


def test_bad_pooling_params_named(llm):
    with pytest.raises(ValueError, match=r"dimensions \(65\) is over this model's hidden size \(64\)"):
        llm.embed("hi", PoolingParams(dimensions=65), use_tqdm=False)
    with pytest.raises(ValueError, match="pooling must be one of last, mean"):
        PoolingParams(pooling="cls")
    with pytest.raises(ValueError, match="dimensions must be a positive integer"):
        PoolingParams(dimensions=0)
    with pytest.raises(TypeError, match="pooling_params must be a PoolingParams"):
        llm.embed("hi", SamplingParams(), use_tqdm=False)
    outs = llm.embed(["fine", ""], use_tqdm=False)  # one bad prompt in a list fails alone
    assert outs[0].embedding is not None and outs[1].finish_reason == "error" and "empty" in outs[1].error


def test_preempted_mean_request_recomputes_the_same_vector(tiny, llm):
    """Generation that outgrows a 10-block cache preempts the embedding request midway
    through its chunked prefill; it restarts from token 0 and its mean forgets the first pass."""
    small = make_llm(tiny[0], num_kvcache_blocks=10, max_num_batched_tokens=8)
    eng = small.engine
    starts = []  # (request id, first token) of every chunk
    eng.runner.observers.append(lambda chunks, *_: starts.extend((r.request_id, r.num_computed_tokens)
                                                                 for r, _ in chunks))
    gen = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    params = PoolingParams(pooling="mean", **RAW)
    long_text = TEXTS[2] + " " + TEXTS[0] * 2
    ids = [eng.add_request(p, gen) for p in ("Hello there", "One two three")]
    for _ in range(20):
        eng.step()
    emb_id = eng.add_request(long_text, params)
    finals = {}
    for _ in range(1000):  # bounded: every request ends well before
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out
        if not eng.has_unfinished_requests():
            break
    assert [s for s in starts if s == (emb_id, 0)] == [(emb_id, 0)] * 2  # started twice from token 0
    alone_gen = llm.generate(["Hello there", "One two three"], gen, use_tqdm=False)
    (alone_emb,) = llm.embed(long_text, params, use_tqdm=False)
    assert [finals[i].token_ids for i in ids] == [o.token_ids for o in alone_gen]
    torch.testing.assert_close(vec(finals[emb_id]), vec(alone_emb), atol=1e-5, rtol=0)
