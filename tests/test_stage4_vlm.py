"""Stage 4 (visual tokens on the paged KV cache): MAC-V1..V3 and cases C08, C15, C16 at the
engine level, against HF ``Qwen2_5_VLForConditionalGeneration`` on the same random weights.

Every engine call here goes through ``LLM.chat``; a recorder wraps
``ModelRunner.forward_logits`` (and the ``prepare_inputs`` it calls) to capture, per step and
per request, the tokens computed, the positions fed to the model, the blocks held and the
logits of the token that was sampled.
"""

from __future__ import annotations

import base64
import io
import math
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from PIL import Image

import atlas_vlm.model_runner as model_runner_module
from atlas_vlm import LLM, SamplingParams
from atlas_vlm.engine import RequestTooLongError
from mm_token_pipeline import ImageInputError

pytestmark = pytest.mark.vlm

IMAGES = Path(__file__).resolve().parent / "data" / "images"
PIX = 28 * 28  # pixels per visual token (patch 14, merge 2)
SMALL = {"max_pixels": 64 * PIX}
MEDIUM = {"max_pixels": 256 * PIX}
MAX_MODEL_LEN = 2048
BLOCK_SIZE = 16
IMAGE_PAD, VISION_START = 151655, 151652
LOGITS_ATOL = 1e-4
CPU_FP32 = dict(device="cpu", dtype="float32")  # exactness is fp32 on CPU, like the HF reference


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n)


def conv(*items, text: str | None = None) -> list[dict]:
    """One user message: ``items`` are image sources (str/Path/bytes/PIL) or full item dicts;
    ``text`` (if given) comes after them."""
    content = []
    for it in items:
        if isinstance(it, dict):
            content.append(it)
        else:
            content.append({"type": "image", "image": str(it) if isinstance(it, Path) else it})
    if text is not None:
        content.append({"type": "text", "text": text})
    return [{"role": "user", "content": content}]


# ---- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vl(tiny_models):
    folder, hf = tiny_models["qwen2_5_vl"]
    return folder, hf.eval()


@pytest.fixture(scope="module")
def llm(vl):
    return LLM(str(vl[0]), max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=512, kvcache_block_size=BLOCK_SIZE,
               **CPU_FP32)


@pytest.fixture(scope="module")
def llm_contiguous(vl):
    return LLM(str(vl[0]), kv_cache="contiguous", max_model_len=1024, num_kvcache_blocks=4, **CPU_FP32)


@pytest.fixture
def hf(vl):
    return vl[1]


# ---- recording ---------------------------------------------------------------------------------
class Recorder:
    """Per request id: list of chunk records, in step order. Each record: ``start``, ``end``,
    ``num_prompt``, ``rope_delta``, ``blocks`` (held when the step ran), ``positions``
    (``[3, n]`` fed to the model), ``logits`` (``[vocab]`` fp32 if this chunk was sampled),
    ``req`` (the engine's Request object), ``step`` (step index)."""

    def __init__(self):
        self.by_request: dict[str, list[dict]] = {}
        self.steps: list[list[dict]] = []
        self.free_before_prefill: list[int] = []

    def first_logits(self, rid: str) -> torch.Tensor:
        (rec,) = [r for r in self.by_request[rid] if r["end"] == r["num_prompt"]]
        return rec["logits"]

    def sampled_logits(self, rid: str) -> list[torch.Tensor]:
        return [r["logits"] for r in self.by_request[rid] if r["logits"] is not None]

    def prefill_positions(self, rid: str) -> torch.Tensor:
        recs = [r for r in self.by_request[rid] if r["start"] < r["num_prompt"]]
        assert recs[0]["start"] == recs[0]["req"].num_cached_tokens
        return torch.cat([r["positions"] for r in recs], dim=1), recs[0]["start"]


@contextmanager
def record(llm):
    runner = llm.engine.runner
    orig_forward = runner.forward_logits
    orig_prepare = model_runner_module.prepare_inputs
    rec = Recorder()
    last = {}

    def prepare(chunks, *args, **kwargs):
        inp = orig_prepare(chunks, *args, **kwargs)
        last["inp"] = inp
        return inp

    def forward(chunks):
        infos = [dict(rid=req.request_id, start=req.num_computed_tokens, end=req.num_computed_tokens + n,
                      num_prompt=req.num_prompt_tokens, rope_delta=req.rope_delta,
                      blocks=list(req.block_table.block_ids), req=req, step=len(rec.steps), logits=None)
                 for req, n in chunks]
        logits, sampled = orig_forward(chunks)
        positions = last.pop("inp").positions.cpu()
        offset = 0
        for info in infos:
            n = info["end"] - info["start"]
            info["positions"] = positions[:, offset:offset + n].clone()
            offset += n
        for row, index in enumerate(sampled):
            infos[index]["logits"] = logits[row].detach().float().cpu().clone()
        for info in infos:
            rec.by_request.setdefault(info["rid"], []).append(info)
        rec.steps.append(infos)
        return logits, sampled

    runner.forward_logits = forward
    model_runner_module.prepare_inputs = prepare
    try:
        yield rec
    finally:
        del runner.forward_logits
        model_runner_module.prepare_inputs = orig_prepare


def chat(llm, convs, n_tokens, mm_options=None):
    """One ``llm.chat`` call over a list of conversations, recorded; checks MAC-V2 block
    accounting on the way (blocks held after prefill scheduling, all free after)."""
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    with record(llm) as rec:
        outs = llm.chat(convs, greedy(n_tokens), mm_options=mm_options, use_tqdm=False)
    for rid, recs in rec.by_request.items():
        first = recs[0]
        bs = llm.engine.runner.block_size
        if llm.config.kv_cache == "paged":
            # blocks known (and held) before any K/V of the prompt is written
            assert len(first["blocks"]) == math.ceil(first["num_prompt"] / bs), rid
        for r in recs:  # during decode: exactly the blocks the tokens so far need
            if r["start"] >= r["num_prompt"] and llm.config.kv_cache == "paged":
                assert len(r["blocks"]) == math.ceil(r["end"] / bs)
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()
    return outs, rec


# ---- HF reference ------------------------------------------------------------------------------
def hf_inputs(p):
    ids = torch.tensor([p.prompt_token_ids])
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    if p.images:
        kwargs["pixel_values"] = torch.cat([im.pixel_values for im in p.images])
        kwargs["image_grid_thw"] = torch.tensor([list(im.grid_thw) for im in p.images])
    return kwargs


@torch.no_grad()
def hf_reference(hf, p, n_tokens):
    """HF greedy tokens, first-step logits (plain forward) and per-step generate logits."""
    kwargs = hf_inputs(p)
    first = hf(**kwargs).logits[0, -1].float()
    gen = hf.generate(**kwargs, max_new_tokens=n_tokens, do_sample=False, output_logits=True,
                      return_dict_in_generate=True, pad_token_id=151643)
    tokens = gen.sequences[0, kwargs["input_ids"].shape[1]:].tolist()
    return tokens, first, [s[0].float() for s in gen.logits]


def assert_rope_matches_hf(hf, p):
    """MAC-V3: our prompt positions and rope_delta equal HF ``get_rope_index``."""
    kwargs = hf_inputs(p)
    pos, delta = hf.model.get_rope_index(kwargs["input_ids"], kwargs.get("image_grid_thw"), None, None,
                                         kwargs["attention_mask"])
    assert p.mrope_positions.shape == (3, len(p.prompt_token_ids))
    assert torch.equal(p.mrope_positions.long(), pos[:, 0].long())
    assert p.rope_delta == int(delta.reshape(-1)[0])


def assert_matches_hf(llm, hf, conversation, out, rec, n_tokens, mm_options=None):
    """MAC-V1 + MAC-V3 for one request of a recorded call."""
    p = llm.engine.process_prompt({"messages": conversation, "mm_options": mm_options})
    assert out.finish_reason in ("length", "stop") and out.error is None
    assert out.prompt_token_ids == p.prompt_token_ids
    assert_rope_matches_hf(hf, p)
    # positions actually fed to the model during prefill are those of get_rope_index
    fed, start = rec.prefill_positions(out.request_id)
    assert torch.equal(fed, p.mrope_positions[:, start:].long())
    tokens, first, step_logits = hf_reference(hf, p, n_tokens)
    assert out.token_ids == tokens
    torch.testing.assert_close(rec.first_logits(out.request_id), first, atol=LOGITS_ATOL, rtol=0)
    ours = rec.sampled_logits(out.request_id)
    assert len(ours) == len(step_logits) == len(tokens)
    for step, (a, b) in enumerate(zip(ours, step_logits)):
        torch.testing.assert_close(a, b, atol=LOGITS_ATOL, rtol=0, msg=lambda m: f"step {step}: {m}")
    # decode positions: context_len + rope_delta of this request, on all three axes
    for r in rec.by_request[out.request_id]:
        if r["start"] >= r["num_prompt"]:
            expect = torch.arange(r["start"], r["end"]) + p.rope_delta
            assert torch.equal(r["positions"], expect[None].expand(3, -1))
    return p


# ---- MAC-V1 parity -------------------------------------------------------------------------------
def test_one_image_matches_hf(llm, hf):
    c = conv(IMAGES / "chelsea.png", text="Describe this image.")
    (out,), rec = chat(llm, [c], 16, MEDIUM)
    p = assert_matches_hf(llm, hf, c, out, rec, 16, MEDIUM)
    assert len(p.images) == 1 and p.images[0].num_tokens <= 256


def test_single_conversation_chat_matches_list_form(llm):
    c = conv(IMAGES / "chelsea.png", text="Describe this image.")
    (single,) = llm.chat(c, greedy(4), mm_options=SMALL, use_tqdm=False)
    (listed,), _ = chat(llm, [c], 4, SMALL)
    assert single.token_ids == listed.token_ids
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_two_images_of_different_sizes_in_one_prompt(llm, hf):
    c = conv(IMAGES / "chelsea.png", IMAGES / "grace_hopper.jpg", text="Compare the two pictures.")
    (out,), rec = chat(llm, [c], 16, SMALL)
    p = assert_matches_hf(llm, hf, c, out, rec, 16, SMALL)
    assert len(p.images) == 2 and p.images[0].grid_thw != p.images[1].grid_thw
    assert sum(t == IMAGE_PAD for t in p.prompt_token_ids) == sum(im.num_tokens for im in p.images)


def test_image_after_text(llm, hf):
    c = [{"role": "user", "content": [{"type": "text", "text": "Look at this:"},
                                      {"type": "image", "image": str(IMAGES / "coffee.png")}]}]
    (out,), rec = chat(llm, [c], 16, SMALL)
    p = assert_matches_hf(llm, hf, c, out, rec, 16, SMALL)
    first_pad = p.prompt_token_ids.index(IMAGE_PAD)
    text_ids = llm.tokenizer("Look at this:", add_special_tokens=False)["input_ids"]
    before = p.prompt_token_ids[:first_pad]
    assert any(before[i:i + len(text_ids)] == text_ids for i in range(len(before)))


def test_several_requests_with_different_images_in_one_call(llm, hf):
    """Four conversations batched in one call (different images, one text-only, one with the
    image after the text); each equals its own HF run. Decode steps that run requests with
    different rope_deltas together feed each its own ``context_len + rope_delta`` (MAC-V3)."""
    convs = [
        conv(IMAGES / "coffee.png", text="What is in the cup?"),
        conv(IMAGES / "grace_hopper.jpg", text="Who is this?"),
        [{"role": "user", "content": [{"type": "text", "text": "A rocket:"},
                                      {"type": "image", "image": str(IMAGES / "rocket.jpg")},
                                      {"type": "text", "text": "Where is it going?"}]}],
        [{"role": "user", "content": "Just text, no image."}],
    ]
    outs, rec = chat(llm, convs, 16, SMALL)
    assert len(outs) == len(convs)
    deltas = {}
    for c, out in zip(convs, outs):
        p = assert_matches_hf(llm, hf, c, out, rec, 16, SMALL)
        deltas[out.request_id] = p.rope_delta
    assert len(set(deltas.values())) >= 3, deltas

    # a decode step where requests with different rope_deltas run together
    mixed = [step for step in rec.steps
             if len({r["rope_delta"] for r in step if r["start"] >= r["num_prompt"]}) >= 2]
    assert mixed, "no decode step ran two requests with different rope_deltas together"
    for step in mixed:
        for r in step:
            if r["start"] < r["num_prompt"]:
                continue
            assert r["rope_delta"] == deltas[r["rid"]]
            expect = (torch.arange(r["start"], r["end"]) + deltas[r["rid"]])[None].expand(3, -1)
            assert torch.equal(r["positions"], expect)
            assert torch.equal(r["req"].positions(r["start"], r["end"]), expect)


def test_contiguous_cache_equals_paged(llm, llm_contiguous):
    convs = [conv(IMAGES / "chelsea.png", text="Describe."),
             conv(IMAGES / "camera.png", IMAGES / "logo.png", text="Two images.")]
    paged, rec_p = chat(llm, convs, 12, SMALL)
    contiguous, rec_c = chat(llm_contiguous, convs, 12, SMALL)
    for a, b in zip(paged, contiguous):
        assert a.token_ids == b.token_ids
        assert a.prompt_token_ids == b.prompt_token_ids
        la, lb = rec_p.sampled_logits(a.request_id), rec_c.sampled_logits(b.request_id)
        assert len(la) == len(lb) == 12
        for x, y in zip(la, lb):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


# ---- MAC-V2 bounds ---------------------------------------------------------------------------------
@pytest.mark.parametrize("max_tokens_per_image", [4, 16, 63, 64, 100, 256, 1000])
def test_visual_tokens_never_exceed_max_pixels(llm, max_tokens_per_image):
    max_pixels = max_tokens_per_image * PIX + 500  # not a multiple of 784 on purpose
    files = ["chelsea.png", "camera.png", "logo.png", "coffee.png", "rocket.jpg", "grace_hopper.jpg",
             "no_time_for_that_tiny.gif", "strip_31x639.png", "aspect_200.png", "exif_orient6.jpg"]
    for name in files:
        c = conv(IMAGES / name, text="hi")
        p = llm.engine.process_prompt({"messages": c, "mm_options": {"max_pixels": max_pixels,
                                                                     "min_pixels": min(4 * PIX, max_pixels)}})
        (img,) = p.images
        assert 1 <= img.num_tokens <= max_pixels // PIX, (name, img.grid_thw)
        assert img.resized_hw[0] * img.resized_hw[1] <= max_pixels
        assert sum(t == IMAGE_PAD for t in p.prompt_token_ids) == img.num_tokens


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(width=st.integers(1, 1600), height=st.integers(1, 1600), max_tokens=st.integers(4, 600),
       extra=st.integers(0, PIX - 1))
def test_visual_tokens_bound_random_sizes(llm, width, height, max_tokens, extra):
    max_pixels = max_tokens * PIX + extra
    image = Image.new("RGB", (width, height), (width % 256, height % 256, 7))
    c = conv(image, text="size?")
    request = {"messages": c, "mm_options": {"max_pixels": max_pixels}}
    if max(width, height) / min(width, height) > 200:
        with pytest.raises(ImageInputError, match="aspect ratio"):
            llm.engine.process_prompt(request)
        return
    p = llm.engine.process_prompt(request)
    (img,) = p.images
    assert 1 <= img.num_tokens <= max_pixels // PIX
    assert sum(t == IMAGE_PAD for t in p.prompt_token_ids) == img.num_tokens


def _too_long_image():
    return Image.new("RGB", (1400, 1400), (200, 30, 30))  # 2500 tokens at max_pixels 2600*784


def test_c16_image_tokens_over_max_model_len_refused_before_allocation(llm):
    big = conv({"type": "image", "image": _too_long_image(), "max_pixels": 2600 * PIX}, text="What is this?")
    p = llm.engine.process_prompt({"messages": big})
    assert len(p.prompt_token_ids) > MAX_MODEL_LEN  # image tokens push it over
    bm = llm.engine.block_manager
    free = bm.num_free_blocks
    runs = llm.engine.runner.num_encoder_runs
    with pytest.raises(RequestTooLongError, match="max_model_len"):
        llm.chat(big, greedy(4), use_tqdm=False)
    assert bm.num_free_blocks == free == bm.num_blocks
    assert llm.engine.runner.num_encoder_runs == runs  # the vision tower never ran
    assert not llm.engine.requests and not llm.engine.scheduler.waiting and not llm.engine.scheduler.running


def test_c16_prompt_plus_max_tokens_over_max_model_len_refused(llm):
    c = conv({"type": "image", "image": _too_long_image(), "max_pixels": 2000 * PIX}, text="What is this?")
    n = len(llm.engine.process_prompt({"messages": c}).prompt_token_ids)
    assert n < MAX_MODEL_LEN
    bm = llm.engine.block_manager
    with pytest.raises(RequestTooLongError):
        llm.chat(c, greedy(MAX_MODEL_LEN - n + 1), use_tqdm=False)
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.requests


def test_c16_in_a_list_call_is_an_error_output_others_complete(llm):
    good = conv(IMAGES / "coffee.png", text="What is in the cup?")
    big = conv({"type": "image", "image": _too_long_image(), "max_pixels": 2600 * PIX}, text="What is this?")
    (alone,), _ = chat(llm, [good], 8, SMALL)
    outs, rec = chat(llm, [good, big, good], 8, SMALL)
    assert [o.finish_reason for o in outs][1] == "error"
    assert "max_model_len" in outs[1].error and not outs[1].token_ids
    for o in (outs[0], outs[2]):
        assert o.finish_reason in ("length", "stop") and o.token_ids == alone.token_ids
    assert outs[1].request_id not in rec.by_request


# ---- C08 --------------------------------------------------------------------------------------------
def test_c08_literal_special_strings_in_user_text(llm, hf):
    c = conv(IMAGES / "chelsea.png", text="What do '<|image_pad|>' and '<|vision_start|>' mean here?")
    p = llm.engine.process_prompt({"messages": c})  # default max_pixels
    ids = p.prompt_token_ids
    assert sum(t == IMAGE_PAD for t in ids) == 176
    pads = [i for i, t in enumerate(ids) if t == IMAGE_PAD]
    assert pads == list(range(pads[0], pads[0] + 176))  # exactly one run
    assert sum(t == VISION_START for t in ids) == 1
    assert "<|image_pad|>" in llm.tokenizer.decode(ids[pads[-1] + 1:])  # still there, as text
    (out,), rec = chat(llm, [c], 6)
    assert len(out.token_ids) >= 1
    assert_matches_hf(llm, hf, c, out, rec, 6)


# ---- C15 --------------------------------------------------------------------------------------------
def test_c15_bad_files_in_a_batch_beside_a_good_request(llm):
    causes = {"zero_bytes.png": "empty", "truncated.jpg": "truncated", "not_an_image.png": "not an image",
              "bomb_40000x40000.png": "bomb"}
    good = conv(IMAGES / "chelsea.png", text="Describe.")
    (alone,), _ = chat(llm, [good], 8, SMALL)
    convs = [conv(IMAGES / name, text="Describe.") for name in causes]
    convs.insert(2, good)
    outs, rec = chat(llm, convs, 8, SMALL)
    bad = outs[:2] + outs[3:]
    for name, out in zip(causes, bad):
        assert out.finish_reason == "error" and not out.token_ids
        assert name in out.error and causes[name] in out.error, out.error
        assert out.request_id not in rec.by_request
    assert outs[2].finish_reason in ("length", "stop")
    assert outs[2].token_ids == alone.token_ids


def test_c15_single_bad_file_raises_and_leaks_nothing(llm):
    bm = llm.engine.block_manager
    with pytest.raises(ImageInputError, match="truncated.jpg"):
        llm.chat(conv(IMAGES / "truncated.jpg", text="x"), greedy(4), use_tqdm=False)
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.requests


# ---- input forms and per-item options ----------------------------------------------------------------
def test_all_image_input_forms_give_the_same_request(llm):
    path = IMAGES / "chelsea.png"
    raw = path.read_bytes()
    forms = {
        "path": {"type": "image", "image": str(path)},
        "pathlib": {"type": "image", "image": path},
        "file_uri": {"type": "image", "image": path.resolve().as_uri()},
        "data_uri": {"type": "image", "image": "data:image/png;base64," + base64.b64encode(raw).decode()},
        "bytes": {"type": "image", "image": raw},
        "pil": {"type": "image", "image": Image.open(io.BytesIO(raw))},
        "image_url": {"type": "image_url", "image_url": {"url": str(path)}},
        "image_url_data": {"type": "image_url",
                           "image_url": {"url": "data:image/png;base64," + base64.b64encode(raw).decode()}},
    }
    convs = {name: conv(item, text="Describe.") for name, item in forms.items()}
    ref = llm.engine.process_prompt({"messages": convs["path"], "mm_options": SMALL})
    for name, c in convs.items():
        p = llm.engine.process_prompt({"messages": c, "mm_options": SMALL})
        assert p.prompt_token_ids == ref.prompt_token_ids, name
        assert p.images[0].grid_thw == ref.images[0].grid_thw, name
        assert torch.equal(p.images[0].pixel_values, ref.images[0].pixel_values), name
        assert p.images[0].content_hash == ref.images[0].content_hash, name
    outs, _ = chat(llm, list(convs.values()), 4, SMALL)
    for name, out in zip(convs, outs):
        assert out.finish_reason in ("length", "stop"), (name, out.error)
        assert out.token_ids == outs[0].token_ids, name


def test_per_item_max_pixels_overrides_mm_options(llm):
    path = str(IMAGES / "coffee.png")
    override = conv({"type": "image", "image": path, "max_pixels": 16 * PIX},
                    {"type": "image", "image": str(IMAGES / "rocket.jpg")}, text="Two.")
    p = llm.engine.process_prompt({"messages": override, "mm_options": MEDIUM})
    assert p.images[0].num_tokens <= 16 < p.images[1].num_tokens <= 256
    plain = conv(path, str(IMAGES / "rocket.jpg"), text="Two.")
    only_first = llm.engine.process_prompt({"messages": plain, "mm_options": {"max_pixels": 16 * PIX}})
    assert p.images[0].grid_thw == only_first.images[0].grid_thw
    assert torch.equal(p.images[0].pixel_values, only_first.images[0].pixel_values)
    default = llm.engine.process_prompt({"messages": plain, "mm_options": MEDIUM})
    assert p.images[1].grid_thw == default.images[1].grid_thw
    # per-item min_pixels too
    up = conv({"type": "image", "image": str(IMAGES / "no_time_for_that_tiny.gif"), "min_pixels": 32 * PIX},
              text="Tiny.")
    assert llm.engine.process_prompt({"messages": up, "mm_options": SMALL}).images[0].num_tokens >= 32
    # and through chat: the override changes the request (and the tokens match the direct form)
    (a, b), _ = chat(llm, [override, override], 4, MEDIUM)
    assert a.prompt_token_ids == p.prompt_token_ids and a.token_ids == b.token_ids
