"""``scripts/generate.py --model DIR --image ...`` on a tiny checkpoint of each VLM family
added in issue 9: it streams the same words as HF ``generate`` on the same prompt."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from helpers import IMAGES, REPO, hf_inputs
from tiny_vlms import build_tiny_qwen3_vl, build_tiny_smolvlm
from atlas_vlm import LLM

pytestmark = pytest.mark.vlm

BUILDERS = {"qwen3_vl": build_tiny_qwen3_vl, "smolvlm": build_tiny_smolvlm}


def _cli():
    spec = importlib.util.spec_from_file_location("generate_cli", REPO / "scripts" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_generate_with_an_image_equals_hf(family, tmp_path, capsys):
    hf = BUILDERS[family](tmp_path)
    photo, prompt, n = IMAGES / "chelsea.png", "Describe it.", 6
    rc = _cli().main(["--dtype", "float32", "--model", str(tmp_path), "--image", str(photo), "--prompt", prompt,
                      "--max-tokens", str(n), "--max-pixels", str(100_000)])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "[finish_reason=length]" in out.err

    llm = LLM(str(tmp_path), num_kvcache_blocks=64, max_pixels=100_000, dtype="float32")
    p = llm.engine.process_prompt({"messages": [{"role": "user", "content": [
        {"type": "image", "image": str(photo)}, {"type": "text", "text": prompt}]}]})
    kwargs = hf_inputs(p)
    with torch.no_grad():
        seq = hf.generate(**kwargs, max_new_tokens=n, do_sample=False, pad_token_id=llm.tokenizer.pad_token_id)
    expected = llm.tokenizer.decode(seq[0, kwargs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert out.out == expected + "\n"


def test_generate_text_only_on_a_smolvlm_checkpoint(tmp_path, capsys):
    """A SmolVLM2 checkpoint answers text chats (its language model alone) as HF does."""
    hf = build_tiny_smolvlm(tmp_path)
    rc = _cli().main(["--dtype", "float32", "--model", str(tmp_path), "--prompt", "Hello there", "--max-tokens", "6"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    llm = LLM(str(tmp_path), num_kvcache_blocks=64, dtype="float32")
    p = llm.engine.process_prompt({"messages": [{"role": "user", "content": "Hello there"}]})
    assert not p.images
    kwargs = hf_inputs(p)
    with torch.no_grad():
        seq = hf.generate(**kwargs, max_new_tokens=6, do_sample=False, pad_token_id=llm.tokenizer.pad_token_id)
    generated = seq[0, kwargs["input_ids"].shape[1]:]
    assert out.out == llm.tokenizer.decode(generated, skip_special_tokens=True) + "\n"
