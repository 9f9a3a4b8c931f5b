"""The embedded random-weight Qwen2.5-VL used by the CLI when an image comes without --model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import IMAGES
from atlas_vlm import LLM, SamplingParams
from atlas_vlm.default_models import DEFAULT_VLM_VERSION, RANDOM_VLM_NOTICE, default_vlm_model

pytestmark = pytest.mark.vlm

MM = {"max_pixels": 64 * 28 * 28}


def _build_in(root: Path) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATLAS_VLM_CACHE", str(root))
        return Path(default_vlm_model())


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm_cache_a")
    return root, _build_in(root)


def test_builds_once_into_the_cache(built, monkeypatch):
    root, folder = built
    assert folder == root / f"qwen2_5_vl-random-{DEFAULT_VLM_VERSION}"
    assert (folder / "config.json").exists() and (folder / "model.safetensors").exists()
    assert [p.name for p in root.iterdir()] == [folder.name]  # no temporary folder left behind
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setenv("ATLAS_VLM_CACHE", str(root))
    assert default_vlm_model() == str(folder)  # second call reuses the folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp

    cfg = json.loads((folder / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    assert cfg["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert (text["hidden_size"], text["num_hidden_layers"], text["num_attention_heads"],
            text["num_key_value_heads"], text["vocab_size"]) == (256, 4, 4, 2, 151936)
    assert text["rope_parameters"]["mrope_section"] == [8, 12, 12]  # transformers 5's layout
    assert (cfg["vision_config"]["depth"], cfg["vision_config"]["hidden_size"],
            cfg["vision_config"]["out_hidden_size"]) == (4, 128, 256)
    template = (folder / "chat_template.jinja").read_text() if (folder / "chat_template.jinja").exists() \
        else json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]
    assert "<|vision_start|><|image_pad|><|vision_end|>" in template


def test_build_is_deterministic(built, tmp_path):
    _, a = built
    b = _build_in(tmp_path / "cache_b")
    assert a != b
    ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert sorted(ta) == sorted(tb) and len(ta) > 0
    for name in ta:
        assert ta[name].dtype == tb[name].dtype == torch.float32, name
        assert torch.equal(ta[name], tb[name]), name
    assert (a / "config.json").read_text() == (b / "config.json").read_text()


def test_generates_from_an_image_and_matches_hf(built):
    from transformers import Qwen2_5_VLForConditionalGeneration

    _, folder = built
    llm = LLM(str(folder), max_model_len=1024, num_kvcache_blocks=64, device="cpu", dtype="float32")
    messages = [{"role": "user", "content": [{"type": "image", "image": str(IMAGES / "chelsea.png")},
                                             {"type": "text", "text": "Describe this image."}]}]
    (out,) = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8), mm_options=MM, use_tqdm=False)
    assert out.finish_reason in ("length", "stop") and out.error is None
    assert 1 <= len(out.token_ids) <= 8
    p = llm.engine.process_prompt({"messages": messages, "mm_options": MM})
    assert sum(t == 151655 for t in out.prompt_token_ids) == p.images[0].num_tokens <= 64
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks

    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([p.prompt_token_ids])
    with torch.no_grad():
        gen = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=p.images[0].pixel_values,
                          image_grid_thw=torch.tensor([list(p.images[0].grid_thw)]), max_new_tokens=8,
                          do_sample=False, pad_token_id=151643)
    assert out.token_ids == gen[0, ids.shape[1]:].tolist()


def test_notice_says_random_and_how_to_pass_a_real_model():
    notice = RANDOM_VLM_NOTICE.lower()
    assert "random" in notice and "not meaningful" in notice
    assert "--model" in RANDOM_VLM_NOTICE
    assert "Qwen2.5-VL-3B" in RANDOM_VLM_NOTICE and "7B" in RANDOM_VLM_NOTICE
