"""LoRA bad input and bookkeeping: adapters that do not fit are refused at load with the reason
(rank, base shape, target module, not PEFT) and nothing changes; the prefix cache never shares
blocks across adapters; slots are reused; the plan and config say what LoRA runs with."""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from atlas_vlm import LLM, EngineConfig, LoRARequest
from atlas_vlm.lora import LoRAAdapterError
from atlas_vlm.lora.manager import attach_lora
from mm_kv_cache_management import RequestState, block_hash
from helpers import CPU_FP32, greedy, record
from lora_helpers import edit_adapter_config, make_adapter

pytestmark = pytest.mark.text
PROMPT = list(range(1000, 1040))  # 40 tokens: two full blocks of 16


@pytest.fixture(scope="module")
def setup(tiny_models, tmp_path_factory):
    folder, hf = tiny_models["qwen2"]
    root = tmp_path_factory.mktemp("adapters")
    good = [make_adapter(hf, root / f"ok{i}", 10 + i, r=4) for i in range(3)]
    llm = LLM(str(folder), enable_lora=True, max_loras=2, max_lora_rank=8, **CPU_FP32)
    return llm, hf, root, good


def _bad(root, good, name, fix) -> str:
    """A copy of adapter ``good`` made bad by ``fix(folder)``."""
    path = root / name
    shutil.copytree(good, path)
    fix(path)
    return str(path)


def _refused(llm, path, name, *words):
    before = llm.engine.runner.lora.names()
    with pytest.raises(LoRAAdapterError) as e:
        llm.generate(PROMPT, greedy(1), lora_request=LoRARequest(name, 99, path), use_tqdm=False)  # one prompt: raised
    for w in words:
        assert w in str(e.value), str(e.value)
    assert llm.engine.runner.lora.names() == before  # nothing changed
    assert not llm.engine.has_unfinished_requests()


def test_refusals_name_the_reason(setup, tmp_path):
    llm, hf, root, good = setup
    big = make_adapter(hf, tmp_path / "big", 5, r=16)
    _refused(llm, str(big), "big", "'big' refused", "rank r=16 is above max_lora_rank=8")

    def wrong_shape(path):  # an adapter of a model with another hidden size
        t = load_file(str(path / "adapter_model.safetensors"))
        t = {k: (v[:, :32].contiguous() if k.endswith("lora_A.weight") else v) for k, v in t.items()}
        save_file(t, str(path / "adapter_model.safetensors"))
    _refused(llm, _bad(root, good[0], "shape", wrong_shape), "shape", "do not fit the base model's", "an adapter of another model")
    _refused(llm, _bad(root, good[0], "tgt", lambda p: edit_adapter_config(p, target_modules=["q_proj", "lm_head"])),
             "tgt", "target modules ['lm_head'] are not supported")
    _refused(llm, _bad(root, good[0], "dora", lambda p: edit_adapter_config(p, use_dora=True)), "dora", "DoRA")
    _refused(llm, str(tmp_path), "empty", "adapter_config.json + adapter_model.safetensors")
    # the engine still serves the base and a good adapter afterwards
    out = llm.generate([PROMPT], greedy(2), lora_request=LoRARequest("ok0", 1, str(good[0])), use_tqdm=False)
    assert len(out[0].token_ids) == 2


def test_lora_request_needs_enable_lora_and_valid_fields():
    with pytest.raises(ValueError, match="lora_int_id must be an int >= 1"):
        LoRARequest("x", 0, "/tmp")
    with pytest.raises(ValueError, match="max_lora_rank must be an int >= 1"):
        EngineConfig(model="m", max_lora_rank=0)
    req = RequestState("r", [1, 2])
    with pytest.raises(ValueError, match="start it with enable_lora=True"):  # the engine's runner.lora is None
        attach_lora(None, req, LoRARequest("x", 1, "/tmp"))
    with pytest.raises(TypeError, match="lora_request must be a LoRARequest"):
        attach_lora(None, req, "x")
    assert req.cache_salt is None


def test_prefix_cache_not_shared_across_adapters(setup):
    llm, _, _, good = setup
    a, b = LoRARequest("ok0", 1, str(good[0])), LoRARequest("ok1", 2, str(good[1]))
    starts, prompt = [], list(range(2000, 2040))  # a prompt no other test ran
    for lora in (a, b, a, None, b):
        with record(llm) as rec:
            out = llm.generate([prompt], greedy(1), lora_request=lora, use_tqdm=False)
        starts.append(rec.by_request[out[0].request_id][0]["start"])  # tokens served by a prefix-cache hit
    assert starts == [0, 0, 32, 0, 32]  # a hit only with the same adapter (two full blocks)
    # the salt is in block 0's hash, so every later block (and its disk-tier file name) differs too
    tokens = list(range(16))
    assert len({block_hash(None, tokens), block_hash(None, tokens, (), "lora:a"), block_hash(None, tokens, (), "lora:b")}) == 3
    assert block_hash(b"p", tokens, (), "lora:a") == block_hash(b"p", tokens)  # carried by the parent


def test_slots_are_reused_and_plan_runs_eager(setup):
    llm, _, _, good = setup
    loras = [LoRARequest(f"ok{i}", i + 1, str(p)) for i, p in enumerate(good)]
    outs = llm.generate([PROMPT] * 3, greedy(2), lora_request=loras[:2] + [None], use_tqdm=False)
    assert all(len(o.token_ids) == 2 for o in outs)
    out = llm.generate([PROMPT], greedy(2), lora_request=loras[2], use_tqdm=False)  # evicts an idle adapter
    assert len(out[0].token_ids) == 2 and len(llm.engine.runner.lora.slots) == 2
    outs = llm.generate([PROMPT] * 3, greedy(1), lora_request=loras, use_tqdm=False)  # 3 adapters in flight, 2 slots
    assert [o.finish_reason for o in outs[:2]] == ["length"] * 2  # the others run
    assert outs[2].finish_reason == "error" and "all max_loras=2 LoRA slots" in outs[2].error
    lora = llm.engine.runner.lora  # the planner's count is the slots' bytes
    held = sum(w.lora_a.numel() + sum(b.numel() for b in w.lora_b) for layer in lora.layers for w in layer.values())
    # sum(in + out) of q/k/v/o/gate/up/down: 128 + 96 + 96 + 128 + 192 + 192 + 192 = 1024 (hidden 64, kv 32, mlp 128)
    assert lora.memory_bytes == held * 4 == 2 * 8 * 1024 * 2 * 4  # slots x rank x 1024 x layers x fp32
    plan = llm.engine.plan
    assert plan.lora.value == (2, 8) and not plan.compile_decode.value and not plan.decode_step.value
    assert "enable_lora" in plan.compile_decode.reason
