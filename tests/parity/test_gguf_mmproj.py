"""VLM GGUF pairs (``LLM(model="x.gguf", mmproj="mmproj-x.gguf")``): the tiny random Qwen2.5-VL /
Qwen2-VL / Qwen3-VL (DeepStack) / SmolVLM2 (idefics3) checkpoints converted by llama.cpp's own
``convert_hf_to_gguf.py`` (F32, and Q8_0 as the converter writes it) give in our engine the
same greedy tokens and logits (fp32, within 1e-4) as HF on the original folder, for text only,
one image, two images and a video; the Q8_0 pair's teacher-forced top-1 agrees with the F32
pair's; bad pairs are refused by name before any work.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gguf_pairs import CONVERTER, IMAGE_MEAN, IMAGE_STD, Pairs
from teacher_forcing import record_logits
from helpers import CPU_FP32, IMAGES, SMALL, assert_matches_hf, chat, conv
from atlas_vlm import LLM, SamplingParams
from atlas_vlm.layers.quant_linear import Int8Linear

pytestmark = [pytest.mark.vlm, pytest.mark.skipif(not CONVERTER.is_file(), reason=(
    f"llama.cpp's converter {CONVERTER} is absent: run `bash scripts/setup.sh`"))]

PIX = 28 * 28
VIDEO = Path(__file__).resolve().parent.parent / "data" / "videos" / "frames_30fps_90.mp4"
N = 8
ENGINE = dict(max_model_len=2048, num_kvcache_blocks=256, kvcache_block_size=16, **CPU_FP32)
# teacher-forced top-1 agreement of the Q8_0 pair with the F32 pair, 4 prompts x N positions
# on random tiny weights (small top-1 margins); measured: Qwen2.5-VL 27/32 dequantized, 28/32 as
# stored; Qwen2-VL 31/32 both; Qwen3-VL 30/32 both; SmolVLM2 29/32 dequantized, 28/32 as stored
MIN_Q8_AGREEMENT = 0.8
# largest |Q8_0 - F32| first-step logit of the image prompt, as a fraction of the F32 logits' std;
# measured 0.07-0.14 (Qwen3-VL as stored the most); SmolVLM2's first token is a near-tie (differs)
MAX_Q8_LOGIT_ERROR = 0.25
FAMILIES = ["qwen2_5_vl", "qwen2_vl", "qwen3_vl", "smolvlm"]
# image options per family: Qwen3-VL's tokens are 32x32 px (released min_pixels 65536 lowered);
# SmolVLM2 takes a longest edge (at most 2x2 tiles + the global view)
MM = {"qwen2_5_vl": SMALL, "qwen2_vl": SMALL, "qwen3_vl": {"min_pixels": 4 * 1024, "max_pixels": 64 * 1024},
      "smolvlm": {"max_pixels": 128 * 128}}
# what the pair's config must carry over from the source folder's (beside the processor's mean / std)
CARRIED = {"qwen2_5_vl": ["vision_config.patch_size", "vision_config.fullatt_block_indexes", "image_token_id"],
           "qwen2_vl": ["vision_config.patch_size", "vision_config.mlp_ratio", "image_token_id"],
           "qwen3_vl": ["vision_config.patch_size", "vision_config.deepstack_visual_indexes",
                        "vision_config.num_position_embeddings", "vision_config.hidden_act", "image_token_id",
                        "text_config.head_dim"],
           "smolvlm": ["scale_factor", "vision_config.image_size", "vision_config.patch_size",
                       "vision_config.layer_norm_eps", "image_token_id", "text_config.head_dim"]}


@pytest.fixture(scope="session")
def pairs(tmp_path_factory):
    return Pairs(tmp_path_factory.mktemp("gguf_pairs"))


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, pairs):
    entry = pairs[request.param]
    model, mmproj = entry["f32"]
    return dict(entry, family=request.param), LLM(str(model), mmproj=str(mmproj), **ENGINE)


def _video(family: str):
    if family == "smolvlm":  # SmolVLM2 samples by fps and resizes to its own video size (no pixel options)
        return {"type": "video", "video": str(VIDEO), "max_frames": 3}
    pix = 1024 if family == "qwen3_vl" else PIX
    return {"type": "video", "video": str(VIDEO), "min_pixels": 4 * pix, "max_pixels": 16 * pix}


CONVERSATIONS = {
    "text": lambda family: [{"role": "user", "content": "Say something about the sea."}],
    "one_image": lambda family: conv(IMAGES / "chelsea.png", text="Describe this image."),
    "two_images": lambda family: conv(IMAGES / "chelsea.png", IMAGES / "grace_hopper.jpg", text="Compare them."),
    "video": lambda family: conv(_video(family), text="What happens?"),
}


@pytest.mark.parametrize("case", list(CONVERSATIONS))
def test_f32_pair_matches_hf_folder(pair, case):
    entry, llm = pair
    c, mm = CONVERSATIONS[case](entry["family"]), MM[entry["family"]]
    if case == "video" and entry["family"] == "smolvlm":
        mm = None  # SmolVLM2 refuses pixel bounds on a video by name
    (out,), rec = chat(llm, [c], N, mm)
    p = assert_matches_hf(llm, entry["hf"], c, out, rec, N, mm)
    owners = {getattr(im, "image_index", i) for i, im in enumerate(p.images)}  # SmolVLM: one item per tile
    assert len(owners) == {"one_image": 1, "two_images": 2}.get(case, 0)
    assert bool(p.videos) == (case == "video")


def _attr(config, path: str):
    for part in path.split("."):
        config = getattr(config, part)
    return config


def test_pair_carries_processor_settings_and_template(pair):
    entry, llm = pair
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer

    from atlas_vlm.loader import load_model

    loaded = load_model(entry["f32"][0], mmproj=entry["f32"][1])
    source = AutoConfig.from_pretrained(entry["folder"])
    for path in CARRIED[entry["family"]]:
        assert _attr(loaded.hf_config, path) == _attr(source, path), path
    mrope = (source.text_config.rope_parameters or {}).get("mrope_section")
    assert loaded.hf_config.text_config.rope_parameters.get("mrope_section") == mrope  # from the GGUF's M-RoPE
    settings = loaded.image_settings
    assert list(settings.image_mean) == pytest.approx(IMAGE_MEAN, abs=1e-7)
    assert list(settings.image_std) == pytest.approx(IMAGE_STD, abs=1e-7)
    v = source.vision_config
    geometry = (0, 0, 0) if entry["family"] == "smolvlm" else (v.patch_size, v.spatial_merge_size, 2)
    assert (settings.patch_size, settings.merge_size, settings.temporal_patch_size) == geometry
    hf_tok = loaded.tokenizer
    ref = AutoTokenizer.from_pretrained(entry["folder"])
    assert hf_tok.chat_template == ref.chat_template and "<|im_start|>" in hf_tok.chat_template
    c = CONVERSATIONS["text"](entry["family"])
    assert hf_tok.apply_chat_template(c, tokenize=True, add_generation_prompt=True, return_dict=False) == \
        ref.apply_chat_template(c, tokenize=True, add_generation_prompt=True, return_dict=False)
    if entry["family"] == "smolvlm":  # tiles, image_seq_len and longest edge: the source processor's prompt ids
        from mm_token_pipeline import load_image

        c = CONVERSATIONS["one_image"]("smolvlm")
        p = llm.engine.process_prompt({"messages": c})
        proc = AutoProcessor.from_pretrained(entry["folder"])
        text = proc.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
        want = proc(text=text, images=[load_image(IMAGES / "chelsea.png")], return_tensors="pt")
        assert p.prompt_token_ids == want["input_ids"][0].tolist()
        assert settings.longest_edge == proc.image_processor.size["longest_edge"]


def _prefixes(llm: LLM) -> tuple[list[list[int]], list[int]]:
    """Teacher-forced inputs: each text prompt followed by 0..N-1 of the F32 pair's greedy tokens."""
    tok = llm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False)
               for t in ("Hello there.", "Name a colour.", "Count to five.", "Why is the sky blue?")]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True), use_tqdm=False)
    return [p + o.token_ids[:i] for p, o in zip(prompts, outs) for i in range(N)], [t for o in outs for t in o.token_ids]


@pytest.mark.parametrize("quantization", ["dequantize", None, "gguf_int"])
def test_q8_0_pair_agrees_with_f32_pair(pair, pairs, quantization):
    entry, llm = pair
    prefixes, want = _prefixes(llm)
    model, mmproj = entry["q8_0"]
    q8 = LLM(str(model), mmproj=str(mmproj), quantization=quantization, **ENGINE)
    mods = list(q8.engine.runner.model.modules())
    if quantization is None:  # as stored (the default): GGUFLinear where rows are whole super-blocks, else
        assert not any(isinstance(m, Int8Linear) for m in mods)  # the dense copy; never int8 tiles
    if quantization == "gguf_int":  # converted to int8 tiles
        assert any(isinstance(m, Int8Linear) for m in mods)
    outs = q8.generate(prefixes, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    got = [o.token_ids[0] for o in outs]
    agreement = sum(a == b for a, b in zip(got, want)) / len(want)
    assert agreement >= MIN_Q8_AGREEMENT, agreement
    # an image through the Q8_0 tower: the same prompt, and the first greedy token the F32 pair's or
    # a near-tie of it (its F32 logit within twice the largest Q8_0 logit error of the F32's top-1)
    c, mm = CONVERSATIONS["one_image"](entry["family"]), MM[entry["family"]]
    logits = [record_logits(x) for x in (llm, q8)]
    try:
        (a,) = llm.chat(c, SamplingParams(temperature=0, max_tokens=1), mm_options=mm, use_tqdm=False)
        (b,) = q8.chat(c, SamplingParams(temperature=0, max_tokens=1), mm_options=mm, use_tqdm=False)
    finally:
        llm.engine.runner.observers.pop()
    assert a.prompt_token_ids == b.prompt_token_ids
    f32, q = (lg[tuple(a.prompt_token_ids)][0] for lg in logits)
    err = (f32 - q).abs().max().item()
    assert err < MAX_Q8_LOGIT_ERROR * f32.std().item()
    assert f32[a.token_ids[0]] - f32[b.token_ids[0]] <= 2 * err


def _fake_mmproj(path: Path, projector: str, width: int) -> Path:
    """A header-only mmproj GGUF (one tiny tensor) with ``projector`` and projection ``width``."""
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "clip")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", projector)
    w.add_uint32("clip.vision.projection_dim", width)
    w.add_tensor("mm.0.bias", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_bad_pairs_are_refused_by_name_before_any_work(pairs, tmp_path, monkeypatch):
    from atlas_vlm.loader import load_model

    monkeypatch.setenv("ATLAS_VLM_CACHE", str(tmp_path / "cache"))
    model, mmproj = pairs["qwen2_5_vl"]["f32"]
    cases = [
        (model, model, rf"mmproj file {model} is not an mmproj GGUF"),
        (mmproj, mmproj, rf"model GGUF {mmproj} is an mmproj file"),
        (model, _fake_mmproj(tmp_path / "wide.gguf", "qwen2.5vl_merger", 128),
         r"projects to width 128, but model GGUF .* has hidden size 64: the mmproj belongs to another model"),
        (model, pairs["qwen3_vl"]["f32"][1],  # a Qwen3-VL tower with a Qwen2.5-VL decoder of the same width
         r"has architecture 'qwen2vl', but mmproj .* is a qwen3_vl tower, whose language model llama.cpp writes "
         r"as 'qwen3vl'"),
        (pairs["smolvlm"]["f32"][0], mmproj, r"has architecture 'llama', but mmproj .* is a qwen2_5_vl tower"),
        (model, _fake_mmproj(tmp_path / "gemma.gguf", "gemma3", 64),
         r"has projector type 'gemma3'; supported: idefics3, qwen2.5vl_merger, qwen2vl_merger, qwen3vl_merger "
         r"\(Qwen2-VL, Qwen2.5-VL, Qwen3-VL, SmolVLM2\)"),
    ]
    for m, mm, match in cases:
        with pytest.raises(ValueError, match=match):
            load_model(m, mmproj=mm)
    assert not (tmp_path / "cache").exists()  # nothing converted
    with pytest.raises(ValueError, match=r"mmproj=.* needs model to be its language model's .gguf file"):
        LLM(str(pairs["qwen2_5_vl"]["folder"]), mmproj=str(mmproj), **ENGINE)


def test_mmproj_flag_on_generate_and_serve(pairs, capsys):
    """``scripts/generate.py --mmproj`` prints what the library answers on the pair;
    ``atlas-vlm serve MODEL --mmproj PATH`` puts it into the engine config."""
    import importlib.util

    from helpers import REPO
    from atlas_vlm.entrypoints import cli
    from atlas_vlm.entrypoints.openai.cli_args import engine_config_from_args

    entry = pairs["qwen2_5_vl"]
    model, mmproj = entry["f32"]
    llm = LLM(str(model), mmproj=str(mmproj), **ENGINE)
    spec = importlib.util.spec_from_file_location("generate_cli", REPO / "scripts" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    rc = generate.main(["--dtype", "float32", "--model", str(model), "--mmproj", str(mmproj), "--image",
                        str(IMAGES / "chelsea.png"), "--max-pixels", str(SMALL["max_pixels"]), "--prompt", "Describe it.",
                        "--max-tokens", "6"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    msgs = conv(IMAGES / "chelsea.png", text="Describe it.")
    (expected,) = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=6), mm_options=SMALL, use_tqdm=False)
    assert out.out == expected.text + "\n"
    args = cli.build_parser().parse_args(["serve", str(model), "--mmproj", str(mmproj)])
    config = engine_config_from_args(args)
    assert (config.model, config.mmproj) == (str(model), str(mmproj))
    assert engine_config_from_args(cli.build_parser().parse_args(["serve", str(model)])).mmproj is None
