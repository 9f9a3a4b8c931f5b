"""Qwen3.5 as a VLM at the model level against HF transformers 5.25
``Qwen3_5ForConditionalGeneration`` on the same random weights (fp32, CPU): a tiny checkpoint
saved with ``save_pretrained`` and loaded by our loader; our tower built from
``loaded.vision_state_dict`` through the registry's ``vision_tower``; prompt ids, M-RoPE
positions and pixel rows from the family's ``QwenVLInputs``; the decoder driven over the paged
KV cache + state cache with hand-built metadata (``qwen3_5_helpers.StepDriver``), each chunk's
media rows cut by ``input_prep.mm_rows_for_chunk``. Every prefill row's logits within 1e-4 of
HF's forward (``pixel_values`` / ``image_grid_thw``, ``pixel_values_videos`` /
``video_grid_thw``), every decode step's within 1e-4 of HF ``generate``'s, greedy tokens equal:
text only, one image, two images, a video, and a chunked prefill whose boundaries fall inside
an image's placeholder run (the Gated DeltaNet state carried across chunks).
"""

from __future__ import annotations

import pytest
import torch

from atlas_vlm import EngineConfig
from atlas_vlm.engine.chat_input import parse_chat_prompt
from atlas_vlm.engine.input_processor import ProcessedPrompt, placeholder_ranges
from atlas_vlm.loader import load_model
from atlas_vlm.models.registry import import_named, resolve_family
from atlas_vlm.worker.input_prep import mm_rows_for_chunk
from helpers import IMAGES, drop_unused, hf_inputs
from qwen3_5_helpers import StepDriver, build_tiny_qwen3_5, tiny_vl_config

pytestmark = pytest.mark.vlm

TOL = 1e-4
N = 8  # generated tokens per prompt
PX = 32 * 32  # pixels per visual token (patch 16, merge 2)
BOUNDS = {"min_pixels": 16 * PX, "max_pixels": 40 * PX}
VIDEO = {"type": "video", "video": str(IMAGES.parent / "videos" / "frames_30fps_90.mp4"), "max_pixels": 12 * PX,
         "min_pixels": 4 * PX}
ASK = {"type": "text", "text": "What is shown?"}
CONVERSATIONS = {
    "text": [{"role": "user", "content": "Hello there, tell me a story about a cat."}],
    "one_image": [{"role": "user", "content": [{"type": "image", "image": str(IMAGES / "chelsea.png")}, ASK]}],
    "two_images": [{"role": "user", "content": [{"type": "image", "image": str(IMAGES / "grace_hopper.jpg")},
                                                {"type": "text", "text": "and"},
                                                {"type": "image", "image": str(IMAGES / "rocket.jpg")}, ASK]}],
    "video": [{"role": "user", "content": [VIDEO, ASK]}],
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(HF model, our loaded model, our tower, the family's media inputs)."""
    folder = tmp_path_factory.mktemp("tiny_qwen3_5_vl")
    hf = build_tiny_qwen3_5(folder, seed=21, config=tiny_vl_config())
    loaded = load_model(folder)
    family = resolve_family(loaded.hf_config)
    tower = import_named(family.vision_tower).from_hf_config(loaded.hf_config, loaded.vision_state_dict)
    engine = EngineConfig(model=str(folder))
    media = import_named(family.mm_inputs)(loaded.tokenizer, engine, loaded.hf_config, loaded.image_settings,
                                           engine.multimodal_config.image_bounds(loaded.image_settings))
    return hf, loaded.model, tower, media


def prompt(media, messages) -> ProcessedPrompt:
    """The prompt as the engine's input processor makes it: ids, items, runs, positions."""
    ids, items = media.prompt_ids(parse_chat_prompt({"messages": messages, "mm_options": BOUNDS}))
    p = ProcessedPrompt(ids, mm_items=items)
    p.mm_positions = placeholder_ranges(ids, items, media.placeholder_token_ids())
    p.mrope_positions, p.rope_delta = media.positions(ids, items)
    return p


@torch.no_grad()
def hf_reference(hf, p: ProcessedPrompt):
    """HF's forward logits over the whole prompt ``[n, vocab]``, and ``generate``'s greedy
    tokens and per-step logits."""
    kwargs = drop_unused(hf, hf_inputs(p))
    full = hf(**kwargs).logits[0].float()
    gen = hf.generate(**kwargs, max_new_tokens=N, min_new_tokens=N, do_sample=False, output_logits=True,
                      return_dict_in_generate=True, pad_token_id=151643)
    return full, gen.sequences[0, len(p.prompt_token_ids):].tolist(), [s[0].float() for s in gen.logits]


def run_ours(model, tower, p: ProcessedPrompt, cuts: list[int]):
    """Prefill in chunks ending at ``cuts`` (then the prompt's end), then greedy decode:
    (prefill logits ``[n, vocab]``, tokens, logits of each sampled step)."""
    embeds = dict(zip([it.content_hash for it in p.mm_items], tower.encode(p.mm_items))) if p.mm_items else {}
    ids, positions = p.prompt_token_ids, p.mrope_positions.long()
    run = StepDriver(model, num_blocks=256, num_slots=1)
    run.add("a")
    prefill, start = [], 0
    for end in [*cuts, len(ids)]:
        rows = mm_rows_for_chunk(p.mm_positions, embeds, start, end)
        prefill.append(run.step({"a": ids[start:end]}, {"a": positions[:, start:end]}, {"a": rows})["a"])
        start = end
    prefill = torch.cat(prefill)
    logits, tokens, steps = prefill[-1], [], []
    for i in range(N):
        steps.append(logits)
        tokens.append(int(logits.argmax()))
        pos = torch.full((3, 1), len(ids) + i + p.rope_delta)  # decode: context length + rope delta
        logits = run.step({"a": [tokens[-1]]}, {"a": pos})["a"][0]
    return prefill, tokens, steps


def assert_parity(setup, p: ProcessedPrompt, cuts: list[int] = ()):
    hf, model, tower, _ = setup
    full, tokens, step_logits = hf_reference(hf, p)
    prefill, ours, steps = run_ours(model, tower, p, list(cuts))
    err = (prefill - full).abs().max().item()
    assert err < TOL, f"prefill: max logit error {err:.2e} (scale {full.abs().max().item():.1f})"
    assert ours == tokens
    for i, (a, b) in enumerate(zip(steps, step_logits, strict=True)):
        err = (a - b).abs().max().item()
        assert err < TOL, f"step {i}: max logit error {err:.2e}"


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_prompt_logits_and_greedy_equal_hf(setup, name):
    p = prompt(setup[3], CONVERSATIONS[name])
    kinds = [it.modality for it in p.mm_items]
    assert kinds == {"text": [], "one_image": ["image"], "two_images": ["image"] * 2, "video": ["video"]}[name]
    if name == "video":  # several temporal groups: one placeholder run each, timestamps between
        assert p.mm_items[0].grid_thw[0] > 1 and len(p.mm_positions) == p.mm_items[0].grid_thw[0]
    if p.mm_items:
        assert p.rope_delta != 0
    assert_parity(setup, p)


def test_chunked_prefill_cut_inside_an_image(setup):
    """Chunk boundaries at 5 and 17 tokens into the image's placeholder run: each chunk embeds
    its slice of the image's rows, and the linear-attention state crosses the cuts."""
    p = prompt(setup[3], CONVERSATIONS["one_image"])
    (span,) = p.mm_positions
    assert span.length > 20
    cuts = [span.offset + 5, span.offset + 17]
    assert [len(rows) for _, rows in mm_rows_for_chunk(p.mm_positions, {span.content_hash: torch.zeros(span.length, 1)},
                                                        cuts[0], cuts[1])] == [12]
    assert_parity(setup, p, cuts)


def test_media_rows_matter(setup):
    """The image rows are really used: HF's logits with the image differ from ours on the same
    ids with the pads left as token embeddings (so the parity above checks the tower and where
    its rows go)."""
    hf, model, _, media = setup
    p = prompt(media, CONVERSATIONS["one_image"])
    full = hf_reference(hf, p)[0]
    run = StepDriver(model, num_blocks=256, num_slots=1)
    run.add("a")
    no_image = run.step({"a": p.prompt_token_ids}, {"a": p.mrope_positions.long()})["a"]  # no media rows
    assert (no_image[-1] - full[-1]).abs().max() > 100 * TOL


def test_text_only_checkpoint_has_no_tower_or_processor(tmp_path):
    """A ``Qwen3_5ForCausalLM`` checkpoint is the text family: no vision weights, no image
    settings, no media inputs; the VLM checkpoint's settings come from its tower's geometry."""
    build_tiny_qwen3_5(tmp_path / "text", seed=3, text_only=True)
    loaded = load_model(tmp_path / "text")
    family = resolve_family(loaded.hf_config)
    assert (family.name, family.multimodal, family.vision_tower, family.mm_inputs) == ("qwen3_5_text", False,
                                                                                       None, None)
    assert loaded.vision_state_dict is None and loaded.image_settings is None
    build_tiny_qwen3_5(tmp_path / "vl", seed=3, config=tiny_vl_config())
    vl = load_model(tmp_path / "vl")
    assert resolve_family(vl.hf_config).multimodal and vl.vision_state_dict
    s = vl.image_settings
    assert (s.patch_size, s.merge_size, s.temporal_patch_size, s.min_pixels, s.max_pixels) == (16, 2, 2, 65536,
                                                                                               16777216)
