"""The fallback tools prompt on the VLM path (issue 24): the tiny random Qwen2.5-VL takes the
built-in Qwen2.5-VL template, which does not render ``tools``, so they go into the system
message (``atlas_vlm/inputs/tool_prompt.py``) with the image still in place."""

from __future__ import annotations

import pytest

from helpers import CPU_FP32, IMAGES
from atlas_vlm import LLM
from atlas_vlm.inputs.tool_prompt import tools_system_text

pytestmark = pytest.mark.vlm

TOOLS = [{"type": "function", "function": {"name": "zoom", "description": "Zoom into the image", "parameters": {
    "type": "object", "properties": {"factor": {"enum": [1, 2, 4]}}, "required": ["factor"]}}}]
ASK = [{"role": "user", "content": [{"type": "image", "image": str(IMAGES / "chelsea.png")},
                                    {"type": "text", "text": "Zoom in?"}]}]


def test_tools_reach_the_vlm_prompt(tiny_models):
    llm = LLM(str(tiny_models["qwen2_5_vl"][0]), max_model_len=1024, num_kvcache_blocks=128, **CPU_FP32)
    plain = llm.engine.process_prompt({"messages": ASK})
    with_tools = llm.engine.process_prompt({"messages": ASK, "tools": TOOLS})
    text = llm.tokenizer.decode(with_tools.prompt_token_ids)
    assert "<tools>" not in llm.tokenizer.decode(plain.prompt_token_ids)
    assert text.startswith("<|im_start|>system\n" + tools_system_text(TOOLS) + "<|im_end|>\n<|im_start|>user\n")
    assert text.count("<|image_pad|>") == llm.tokenizer.decode(plain.prompt_token_ids).count("<|image_pad|>") > 0
