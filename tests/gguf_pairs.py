"""Tiny VLM GGUF pairs made by llama.cpp's own converter (``.venv/llama.cpp``, put there by
scripts/setup.sh): the tiny random HF checkpoint of ``build_tiny_model`` (Qwen2-VL,
Qwen2.5-VL) or ``tiny_vlms`` (Qwen3-VL, SmolVLM2) and its language model + ``mmproj`` GGUFs,
F32 and Q8_0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LLAMA_CPP = REPO / ".venv" / "llama.cpp"
CONVERTER = LLAMA_CPP / "convert_hf_to_gguf.py"
# processor settings the pair must carry over (not the released defaults, so a fallback shows)
IMAGE_MEAN, IMAGE_STD = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]


def convert(folder: Path, out: Path, outtype: str, mmproj: bool) -> Path:
    """Run llama.cpp's ``convert_hf_to_gguf.py`` on ``folder`` (a subprocess of this Python)."""
    env = dict(os.environ, PYTHONPATH=str(LLAMA_CPP / "gguf-py"))
    cmd = [sys.executable, str(CONVERTER), str(folder), "--outtype", outtype, "--outfile", str(out)]
    run = subprocess.run(cmd + (["--mmproj"] if mmproj else []), env=env, capture_output=True, text=True, timeout=600)
    if run.returncode != 0 or not out.is_file():
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{run.stderr[-3000:]}")
    return out


def build_pair_source(family: str, folder: Path):
    """The HF folder the pair is made from, with a processor of ``IMAGE_MEAN`` / ``IMAGE_STD``:
    ``build_tiny_model`` with 3 tower blocks (the converter maps ``merger.mlp.2`` as a block
    index, so it needs 3) and Qwen2.5-VL's ``tokens_per_second`` at the released 2 (a GGUF does
    not carry it); ``build_tiny_qwen3_vl`` (its converter reads the mean / std from a
    ``preprocessor_config.json``, which the tiny folder lacks); ``build_tiny_smolvlm`` with
    ``text_config.architectures`` ``VLlama3ForCausalLM`` as SmolVLM2's released configs say
    (llama.cpp picks the decoder's converter from it). Returns the HF model."""
    import importlib.util

    from transformers import AutoModelForImageTextToText, Qwen2VLImageProcessor

    from tiny_vlms import build_tiny_qwen3_vl, build_tiny_smolvlm

    config_path = folder / "config.json"
    if family == "qwen3_vl":
        build_tiny_qwen3_vl(folder)
        Qwen2VLImageProcessor(image_mean=IMAGE_MEAN, image_std=IMAGE_STD, patch_size=16, merge_size=2,
                              min_pixels=65536, max_pixels=16777216).save_pretrained(folder)
    elif family == "smolvlm":
        from transformers import SmolVLMProcessor

        build_tiny_smolvlm(folder)
        proc = SmolVLMProcessor.from_pretrained(folder)
        for p in (proc.image_processor, proc.video_processor):
            p.image_mean, p.image_std = IMAGE_MEAN, IMAGE_STD
        proc.save_pretrained(folder)
        config = json.loads(config_path.read_text())
        config["text_config"]["architectures"] = ["VLlama3ForCausalLM"]
        config_path.write_text(json.dumps(config, indent=2))
    else:
        # tests/conftest.py by path (pytest imports conftests under its own names)
        spec = importlib.util.spec_from_file_location("tests_conftest_for_pairs", REPO / "tests" / "conftest.py")
        root_conftest = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(root_conftest)
        root_conftest.build_tiny_model(family, folder, vision_depth=3)
        Qwen2VLImageProcessor(image_mean=IMAGE_MEAN, image_std=IMAGE_STD, min_pixels=56 * 56,
                              max_pixels=28 * 28 * 16384).save_pretrained(folder)
        config = json.loads(config_path.read_text())
        if family == "qwen2_5_vl":
            config["vision_config"]["tokens_per_second"] = 2
        config_path.write_text(json.dumps(config, indent=2))
    return AutoModelForImageTextToText.from_pretrained(folder).eval()


class Pairs(dict):
    """``{family: dict(folder=, hf=, f32=(model, mmproj), q8_0=(model, mmproj))}``, each family
    built and converted on first lookup."""

    def __init__(self, root: Path):
        super().__init__()
        self.root = root

    def __missing__(self, family: str):
        folder = self.root / family
        hf = build_pair_source(family, folder)
        entry = dict(folder=folder, hf=hf)
        for outtype in ("f32", "q8_0"):
            entry[outtype] = (convert(folder, self.root / f"{family}-{outtype}.gguf", outtype, False),
                              convert(folder, self.root / f"mmproj-{family}-{outtype}.gguf", outtype, True))
        self[family] = entry
        return entry
