"""Bad input is refused with an error that names its cause: missing or unsupported models,
weights that do not match, invalid sampling / engine settings, a KV budget below one block,
prompts that can never fit (nothing allocated)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from atlas_vlm import LLM, EngineConfig, SamplingParams
from atlas_vlm.engine import RequestTooLongError
from atlas_vlm.loader import ModelNotFoundError
from atlas_vlm.engine.plan import KVBudgetError
from atlas_vlm.models.arch import UnsupportedModelError

pytestmark = pytest.mark.text


@pytest.fixture(scope="module")
def small(tiny_models):
    """Tiny Qwen2 with max_model_len 64 and 8 blocks of 16."""
    return LLM(str(tiny_models["qwen2"][0]), max_model_len=64, num_kvcache_blocks=8, dtype="float32")


def assert_untouched(llm: LLM) -> None:
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks == 8
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)
    assert not engine.requests and not engine.scheduler.has_unfinished()


# ---- models -------------------------------------------------------------------------------
def test_missing_model_path(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(ModelNotFoundError, match="does not exist") as e:
        LLM(str(missing))
    assert str(missing) in str(e.value)


def test_model_file_that_is_not_gguf(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 8)
    with pytest.raises(ModelNotFoundError, match=r"not a \.gguf file"):
        LLM(str(f))


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        LLM(str(tmp_path))


def test_folder_without_weights(tmp_path, tiny_models):
    shutil.copy(tiny_models["qwen2"][0] / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelNotFoundError, match=r"holds no \*\.safetensors weights"):
        LLM(str(tmp_path))


def test_unsupported_architecture_lists_supported_ones(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=64, n_positions=32)).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError) as e:
        LLM(str(tmp_path))
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg
    for supported in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen2_5_VLForConditionalGeneration"):
        assert supported in msg


def test_weights_that_do_not_match_the_config(tmp_path, tiny_models):
    folder = tmp_path / "bad"
    shutil.copytree(tiny_models["qwen2"][0], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 96  # the saved MLP weights are 128 wide
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"weight model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight has shape"):
        LLM(str(folder))


# ---- settings -----------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "cause"), [
    (dict(temperature=-1), "temperature must be >= 0"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(max_tokens=0), "max_tokens must be an int >= 1"),
    (dict(max_tokens=1.5), "max_tokens"),
    (dict(logprobs=-1), "logprobs must be None or >= 0"),
    (dict(stop=[3]), "stop strings must be non-empty strings"),
    (dict(stop=[""]), "stop strings must be non-empty strings"),
    (dict(stop_token_ids=["a"]), "stop_token_ids must be non-negative ints"),
    (dict(stop_token_ids=[-1]), "stop_token_ids must be non-negative ints"),
])
def test_invalid_sampling_params(kwargs, cause):
    with pytest.raises(ValueError, match=cause):
        SamplingParams(**kwargs)


def test_valid_sampling_params_edges():
    p = SamplingParams(temperature=0, top_p=1.0, top_k=-1, max_tokens=None, logprobs=0, stop="x")
    assert p.greedy and p.stop == ["x"]
    assert not SamplingParams(temperature=0.5).greedy


@pytest.mark.parametrize(("kwargs", "cause"), [
    (dict(kv_cache="foo"), "kv_cache must be one of"),
    (dict(kvcache_block_size=0), "kvcache_block_size must be >= 1"),
    (dict(max_num_seqs=0), "max_num_seqs must be >= 1"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be >= 1"),
    (dict(kv_cache_memory=0), "kv_cache_memory must be >= 1"),
    (dict(num_kvcache_blocks=0), "num_kvcache_blocks must be -1"),
    (dict(num_kvcache_blocks=-2), "num_kvcache_blocks must be -1"),
    (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(max_model_len=0), "max_model_len must be >= 1"),
    (dict(min_pixels=10, max_pixels=5), r"min_pixels \(10\) must be <= max_pixels \(5\)"),
    (dict(max_pixels=0), "max_pixels must be an int >= 1"),
    (dict(quantization="fp8"), r"quantization must be None or one of .*got 'fp8'"),
])
def test_invalid_engine_config(kwargs, cause):
    with pytest.raises(ValueError, match=cause):
        EngineConfig(model="unused", **kwargs)


def test_invalid_dtype():
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        EngineConfig(model="unused", dtype="float64", device="cpu").torch_dtype()


def test_llm_rejects_unknown_setting(tiny_models):
    with pytest.raises(TypeError, match="kv_cach"):
        LLM(str(tiny_models["qwen2"][0]), kv_cach="paged")


def test_kv_budget_too_small_for_one_block(tiny_models):
    # tiny model: 2 layers x 2 KV heads x head_dim 16 x K and V x 4 bytes = 512 bytes per token
    with pytest.raises(KVBudgetError, match=r"KV budget of 1 bytes is too small for one block of 16 tokens \(8192 bytes\)"):
        LLM(str(tiny_models["qwen2"][0]), kv_cache_memory=1, max_model_len=512, dtype="float32")
    with pytest.raises(KVBudgetError, match=r"too small for one strip of 512 tokens \(262144 bytes\)"):
        LLM(str(tiny_models["qwen2"][0]), kv_cache="contiguous", kv_cache_memory=8192, max_model_len=512,
            dtype="float32")


def test_kv_budget_of_exactly_one_block(tiny_models):
    llm = LLM(str(tiny_models["qwen2"][0]), kv_cache_memory=8192, max_model_len=512, dtype="float32")
    assert llm.engine.block_manager.num_blocks == 1
    out = llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=13, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 13 and out.finish_reason == "length"  # 16 tokens: the one block
    with pytest.raises(RequestTooLongError, match=r"can never fit the KV cache \(1 blocks, 16 tokens\)"):
        llm.engine.add_request([5, 6, 7], SamplingParams(max_tokens=14))


# ---- prompts ------------------------------------------------------------------------------
def test_prompt_over_max_model_len_refused_before_allocation(small):
    with pytest.raises(RequestTooLongError, match="prompt is 70 tokens .* max_model_len is 64"):
        small.engine.add_request(list(range(100, 170)), SamplingParams(max_tokens=1))
    assert_untouched(small)
    with pytest.raises(RequestTooLongError, match="max_model_len is 64"):
        small.generate("word " * 200, SamplingParams(max_tokens=1), use_tqdm=False)
    assert_untouched(small)
    with pytest.raises(RequestTooLongError, match=r"prompt \(60 tokens\) \+ max_tokens \(5\) = 65 is over max_model_len 64"):
        small.engine.add_request(list(range(100, 160)), SamplingParams(max_tokens=5))
    assert_untouched(small)


def test_max_tokens_none_runs_to_max_model_len(small):
    out = small.generate(list(range(100, 150)), SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                         use_tqdm=False)[0]
    assert len(out.token_ids) == 14 and out.finish_reason == "length"
    assert_untouched(small)


def test_bad_prompts_in_a_list_get_error_outputs(small):
    prompts = [list(range(100, 170)), [1, 2, 3], [10**9], [], "hello there"]
    outs = small.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["error", "length", "error", "error", "length"]
    assert "max_model_len is 64" in outs[0].error
    assert "prompt_token_ids must be a non-empty list of ids" in outs[2].error
    assert "prompt_token_ids must be a non-empty list of ids" in outs[3].error
    assert outs[1].token_ids and len(outs[1].token_ids) == 3 and outs[1].error is None
    assert outs[4].prompt == "hello there" and len(outs[4].token_ids) == 3
    assert_untouched(small)


@pytest.mark.parametrize(("prompt", "exc", "cause"), [
    ({"prompt_token_ids": []}, ValueError, "prompt_token_ids must be a non-empty list"),
    ([1, -1], ValueError, "prompt_token_ids must be a non-empty list of ids in"),
    ([1, 2.0], ValueError, "prompt_token_ids"),
    (3.5, TypeError, "a prompt is a str, a list of token ids or a dict"),
    ({"foo": 1}, TypeError, "a prompt is a str"),
    ("", ValueError, "the prompt is empty"),
])
def test_malformed_single_prompt_raises(small, prompt, exc, cause):
    with pytest.raises(exc, match=cause):
        small.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)
    assert_untouched(small)


def test_empty_prompt_list_is_an_empty_batch(small):
    assert small.generate([], SamplingParams(max_tokens=1), use_tqdm=False) == []
    with pytest.raises(ValueError, match="prompt_token_ids must be a non-empty list"):
        small.engine.add_request([], SamplingParams(max_tokens=1))
    assert_untouched(small)


def test_images_to_a_text_only_model(small):
    messages = [{"role": "user", "content": [{"type": "image", "image": "x.png"}, {"type": "text", "text": "hi"}]}]
    with pytest.raises(ValueError, match="text-only"):
        small.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)
    assert_untouched(small)


def test_duplicate_request_id_and_param_count(small):
    small.engine.add_request([1, 2, 3], SamplingParams(max_tokens=1), request_id="dup")
    try:
        with pytest.raises(ValueError, match="request id 'dup' is already in use"):
            small.engine.add_request([4, 5], SamplingParams(max_tokens=1), request_id="dup")
    finally:
        small.engine.abort_request("dup")
    assert_untouched(small)
    with pytest.raises(ValueError, match="2 prompts but 3 sampling params"):
        small.generate([[1], [2]], [SamplingParams()] * 3, use_tqdm=False)
    assert_untouched(small)


def test_refusal_keeps_kv_bytes(small):
    """A refused request leaves the cache bit-identical while another request is mid-flight."""
    engine = small.engine
    rid = engine.add_request([7, 8, 9, 10], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    engine.step()
    k, v = engine.runner.kv_cache.k_cache.clone(), engine.runner.kv_cache.v_cache.clone()
    free = engine.block_manager.num_free_blocks
    with pytest.raises(RequestTooLongError):
        engine.add_request(list(range(100, 200)), SamplingParams(max_tokens=1))
    assert engine.block_manager.num_free_blocks == free == 7
    assert torch.equal(k, engine.runner.kv_cache.k_cache) and torch.equal(v, engine.runner.kv_cache.v_cache)
    while engine.has_unfinished_requests():
        engine.step()
    assert rid not in engine.requests
    assert_untouched(small)
