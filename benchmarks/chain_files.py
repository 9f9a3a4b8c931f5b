"""The chain-size bench files: random-weight language models with the shapes of the model
chain (Qwen2.5-0.5B-Instruct, the language model of Qwen2.5-VL-3B-Instruct and of
Qwen3-VL-4B-Instruct, from the configs shipped in ``atlas_vlm/data/configs``), converted by
llama.cpp's own ``convert_hf_to_gguf.py`` and quantized by its own ``llama-quantize`` to the
types people download (Q4_K_M, Q8_0).

The tools come from ``scripts/setup.sh --bench`` (``.venv/llama.cpp``: the converter with its
``gguf-py`` and a ``llama-quantize`` built for this CPU from the same source as the peer).
A VLM's language model is benchmarked as the text model of its family (Qwen2 / Qwen3): on
text-only positions M-RoPE is plain RoPE, so decode and prefill do the same work.

Files are cached under ``$ATLAS_VLM_CACHE/chain`` (``~/.cache/atlas_vlm/chain``); the HF
checkpoint and the F16 file are deleted once the quantized files exist (a 4B one is ~8 GB).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
TOOLS = REPO / ".venv" / "llama.cpp"
# name -> (bundled config folder, text model_type for a VLM's language model or None)
CHAIN = {"Qwen2.5-0.5B": ("Qwen2.5-0.5B-Instruct", None),
         "Qwen2.5-VL-3B LM": ("Qwen2.5-VL-3B-Instruct", "qwen2"),
         "Qwen3-VL-4B LM": ("Qwen3-VL-4B-Instruct", "qwen3")}
QUANT_TYPES = ("Q4_K_M", "Q8_0")
TEXT_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "head_dim", "rms_norm_eps", "rope_theta", "vocab_size", "tie_word_embeddings", "attention_bias",
             "bos_token_id", "eos_token_id", "hidden_act")


def tools_missing() -> str | None:
    """None when the converter and quantizer are installed, else what to run."""
    if (TOOLS / "bin" / "llama-quantize").exists() and (TOOLS / "convert_hf_to_gguf.py").exists():
        return None
    return "llama.cpp tools not built (bash scripts/setup.sh --bench)"


def text_config(name: str):
    """The transformers config of chain model ``name``'s language model (a text-only
    ``Qwen2Config`` / ``Qwen3Config`` with the VLM's text shapes)."""
    from transformers import AutoConfig, Qwen2Config, Qwen3Config

    folder, text_type = CHAIN[name]
    path = REPO / "atlas_vlm" / "data" / "configs" / folder
    if text_type is None:
        return AutoConfig.from_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    text = {**{k: v for k, v in raw.items() if k in TEXT_KEYS}, **raw.get("text_config", {})}
    keys = {k: text[k] for k in TEXT_KEYS if k in text}
    keys.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    cls = Qwen2Config if text_type == "qwen2" else Qwen3Config
    return cls(**keys, max_position_embeddings=32768, architectures=[cls.__name__.replace("Config", "ForCausalLM")])


def _checkpoint(name: str, out: Path) -> None:
    """Random bf16 weights (seed 0) with ``name``'s shapes and the Qwen2.5 tokenizer, saved."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from atlas_vlm.models.qwen2_vl.tokenizer_files import qwen_tokenizer_dir

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(text_config(name), dtype=torch.bfloat16)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(qwen_tokenizer_dir()).save_pretrained(out)


def _run(cmd: list[str], what: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}): {done.stderr[-2000:]}")


def chain_files(name: str, types=QUANT_TYPES, log=print) -> dict[str, Path]:
    """The GGUF files of chain model ``name`` for each of ``types`` (made once, then cached).

    Raises:
        RuntimeError: the llama.cpp tools are missing or a conversion step failed (its stderr).
    """
    why = tools_missing()
    if why:
        raise RuntimeError(why)
    root = Path(os.environ.get("ATLAS_VLM_CACHE", Path.home() / ".cache" / "atlas_vlm")) / "chain"
    slug = name.replace(" ", "-").replace(".", "_")
    files = {t: root / f"{slug}-{t}.gguf" for t in types}
    if all(f.exists() for f in files.values()):
        return files
    root.mkdir(parents=True, exist_ok=True)
    hf_dir, f16 = root / f"{slug}-hf", root / f"{slug}-F16.gguf"
    if not f16.exists():
        log(f"chain files: {name}: random weights")
        _checkpoint(name, hf_dir)
        log(f"chain files: {name}: convert_hf_to_gguf.py -> F16")
        _run([sys.executable, str(TOOLS / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", "f16",
              "--outfile", str(f16)], "convert_hf_to_gguf.py")
        shutil.rmtree(hf_dir)
    for t, path in files.items():
        if not path.exists():
            log(f"chain files: {name}: llama-quantize -> {t}")
            _run([str(TOOLS / "bin" / "llama-quantize"), str(f16), str(path), t, str(torch.get_num_threads())],
                 "llama-quantize")
    f16.unlink()
    return files
