"""SmolVLM2 (Idefics3 family) on the paged KV cache against HF
``SmolVLMForConditionalGeneration`` on the same random weights (tests/tiny_vlms.py):
first-step logits within 1e-4, greedy tokens equal ``generate`` (fp32, CPU) -- text only,
one and two images (tiles + global view from the HF processor), batched with other
requests, chunked prefill that splits a tile, prefix and encoder caching with a repeated
image. Also the longest-edge bound and its refusals before any allocation.
"""

from __future__ import annotations

import pytest
import torch

from helpers import CPU_FP32, IMAGES, assert_matches_hf, chat, conv
from tiny_vlms import SMOLVLM_SEQ_LEN, SMOLVLM_TILE, build_tiny_smolvlm
from atlas_vlm import LLM, SamplingParams
from mm_token_pipeline import ImageInputError

pytestmark = pytest.mark.vlm

N = 12
SMALL = {"max_pixels": 128 * 128}  # longest edge 128 px: at most 2x2 tiles + the global view


@pytest.fixture(scope="module")
def sm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_smolvlm")
    return folder, build_tiny_smolvlm(folder)


@pytest.fixture(scope="module")
def hf(sm):
    return sm[1]


@pytest.fixture(scope="module")
def llm(sm):
    return LLM(str(sm[0]), max_model_len=2048, num_kvcache_blocks=512, kvcache_block_size=16, **CPU_FP32)


def test_text_only_matches_hf(llm, hf):
    c = [{"role": "user", "content": "Hello, what can you see today?"}]
    (out,), rec = chat(llm, [c], N)
    p = assert_matches_hf(llm, hf, c, out, rec, N)
    assert not p.images and p.mrope_positions is None
    # a raw text prompt (no chat template) too: the language model alone, as HF generate
    prompt = "The capital of France is"
    (raw,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=N), use_tqdm=False)
    ids = torch.tensor([llm.tokenizer(prompt)["input_ids"]])
    with torch.no_grad():
        ref = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, do_sample=False)
    assert raw.token_ids == ref[0, ids.shape[1]:].tolist()


def test_one_image_tiles_and_tokens_come_from_the_hf_processor(llm, hf):
    c = conv(IMAGES / "chelsea.png", text="Describe this image.")
    (out,), rec = chat(llm, [c], N)
    p = assert_matches_hf(llm, hf, c, out, rec, N)
    proc = llm.engine.input_processor.chat.media.hf_processor
    # chelsea 451x300 at longest edge 256: 256x(ceil(170/64)*64=192) -> 4x3 tiles + global
    assert len(p.images) == 4 * 3 + 1
    text = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                     {"type": "text", "text": "Describe this image."}]}],
                                    add_generation_prompt=True, tokenize=False)
    from mm_token_pipeline import load_image

    ref = proc(text=text, images=[load_image(IMAGES / "chelsea.png")], return_tensors="pt")
    assert p.prompt_token_ids == ref["input_ids"][0].tolist()
    tokens = proc.tokenizer.convert_ids_to_tokens(p.prompt_token_ids)
    assert "<row_3_col_4>" in tokens and "<row_4_col_1>" not in tokens and tokens.count("<global-img>") == 1
    assert tokens.count("<image>") == 13 * SMOLVLM_SEQ_LEN


def test_two_images_in_one_prompt(llm, hf):
    c = conv(IMAGES / "chelsea.png", IMAGES / "grace_hopper.jpg", text="Compare the pictures.")
    (out,), rec = chat(llm, [c], N, SMALL)
    p = assert_matches_hf(llm, hf, c, out, rec, N, SMALL)
    owners = [t.image_index for t in p.images]
    assert owners == sorted(owners) and set(owners) == {0, 1}


def test_batched_with_other_requests(llm, hf):
    convs = [
        conv(IMAGES / "coffee.png", text="What is in the cup?"),
        [{"role": "user", "content": "Just text, no image."}],
        [{"role": "user", "content": [{"type": "text", "text": "A rocket:"},
                                      {"type": "image", "image": str(IMAGES / "rocket.jpg")},
                                      {"type": "text", "text": "Where is it going?"}]}],
    ]
    outs, rec = chat(llm, convs, N, SMALL)
    for c, out in zip(convs, outs):
        assert_matches_hf(llm, hf, c, out, rec, N, SMALL)
    assert any(len(step) >= 3 for step in rec.steps), "the requests never ran in one batch"


def test_chunked_prefill_splits_a_tile(sm, hf):
    # the encoder budget set apart from the 20-token step: chunks cut by tokens only, so inside tiles
    llm = LLM(str(sm[0]), max_model_len=1024, num_kvcache_blocks=128, max_num_batched_tokens=20,
              max_num_encoder_tokens=4096, **CPU_FP32)
    c = conv(IMAGES / "chelsea.png", text="Describe this image.")
    (out,), rec = chat(llm, [c], N, SMALL)
    p = assert_matches_hf(llm, hf, c, out, rec, N, SMALL)
    cuts = [r["start"] for r in rec.by_request[out.request_id] if r["start"] < r["num_prompt"]]
    inside = [x for x in cuts for s in p.image_spans if s.offset < x < s.offset + s.length]
    assert len(inside) >= 2, (cuts, p.image_spans)


def test_prefix_and_encoder_cache_with_a_repeated_image(sm, hf):
    llm = LLM(str(sm[0]), max_model_len=1024, num_kvcache_blocks=128, **CPU_FP32)
    first = conv(IMAGES / "chelsea.png", text="Describe this image.")
    (out1,), rec1 = chat(llm, [first], N, SMALL)
    p1 = assert_matches_hf(llm, hf, first, out1, rec1, N, SMALL)
    runs = llm.engine.runner.num_encoder_runs
    assert runs == len(p1.images)  # one per tile
    second = conv(IMAGES / "chelsea.png", text="What colour is the cat?")
    (out2,), rec2 = chat(llm, [second], N, SMALL)
    p2 = assert_matches_hf(llm, hf, second, out2, rec2, N, SMALL)
    last = p2.image_spans[-1]
    assert rec2.by_request[out2.request_id][0]["req"].num_cached_tokens >= last.offset + last.length - 16
    assert llm.engine.runner.num_encoder_runs == runs


@pytest.mark.parametrize("max_pixels, edge", [(128 * 128, 128), (200 * 200, 192), (10**9, 4 * SMOLVLM_TILE)])
def test_max_pixels_maps_to_a_longest_edge_and_bounds_tokens(llm, max_pixels, edge):
    for name in ("chelsea.png", "strip_31x639.png", "logo.png"):
        p = llm.engine.process_prompt({"messages": conv(IMAGES / name, text="Hi"),
                                       "mm_options": {"max_pixels": max_pixels}})
        tiles = len(p.images)
        assert tiles <= (edge // SMOLVLM_TILE) ** 2 + 1, name
        assert sum(t.num_tokens for t in p.images) <= ((edge // SMOLVLM_TILE) ** 2 + 1) * SMOLVLM_SEQ_LEN
    # the same bound in SmolVLM's own terms; chelsea (451x300) at that edge: 2x2, 2x3, 3x4 tiles + global
    by_edge = llm.engine.process_prompt({"messages": conv(IMAGES / "chelsea.png", text="Hi"),
                                         "mm_options": {"longest_edge": edge}})
    by_pixels = llm.engine.process_prompt({"messages": conv(IMAGES / "chelsea.png", text="Hi"),
                                           "mm_options": {"max_pixels": max_pixels}})
    assert len(by_edge.images) == len(by_pixels.images) == {128: 5, 192: 7, 256: 13}[edge]


def test_bounds_are_refused_before_allocation(sm):
    llm = LLM(str(sm[0]), max_model_len=120, num_kvcache_blocks=64, **CPU_FP32)
    bm = llm.engine.block_manager
    with pytest.raises(ImageInputError, match="below one 64x64 SmolVLM tile"):
        llm.engine.add_request({"messages": conv(IMAGES / "chelsea.png", text="Hi"),
                                "mm_options": {"max_pixels": 63 * 63}})
    with pytest.raises(ValueError, match="max_model_len"):  # 13 tiles x 16 tokens > 120
        llm.engine.add_request({"messages": conv(IMAGES / "chelsea.png", text="Hi")})
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.requests


@pytest.mark.parametrize("text, match", [("what is <image> here?", "number of <image> tokens"),
                                         ("row <row_1_col_1> here", "literal image token")])
def test_literal_image_tokens_in_user_text_are_refused(llm, text, match):
    """The HF processor tokenizes user text with special tokens recognised (unlike the Qwen
    path, which keeps them as plain text); a literal image token is refused, never miscounted."""
    with pytest.raises(ValueError, match=match):
        llm.engine.add_request({"messages": conv(IMAGES / "chelsea.png", text=text)})
    assert not llm.engine.requests


@pytest.mark.parametrize("size", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_one_and_two_pixel_images_are_read_channels_last(llm, size):
    """A (1, 1, 3) array is ambiguous to transformers (it would read channels-first); ours
    goes in channels-last, so the tiles equal the HF processor's when told the layout."""
    from PIL import Image

    image = Image.new("RGB", size, (200, 30, 90))
    p = llm.engine.process_prompt({"messages": conv(image, text="Hi")})
    proc = llm.engine.input_processor.chat.media.hf_processor
    text = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}],
                                    add_generation_prompt=True, tokenize=False)
    ref = proc(text=text, images=[image], return_tensors="pt", input_data_format="channels_last")
    assert p.prompt_token_ids == ref["input_ids"][0].tolist()
    assert len(p.images) == ref["pixel_values"].shape[1]
    if size[0] == size[1]:  # upscaled to the 4-tile longest edge: 4 x 4 tiles + the global view
        assert len(p.images) == 4 * 4 + 1
