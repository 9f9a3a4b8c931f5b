"""Shared helpers for the stage 4 (VLM) engine tests (test_stage4_vlm_parity.py,
test_stage4_vlm_bounds.py): constants, conversation builders, the forward-pass recorder, the
recorded ``chat`` call (with its MAC-V2 block accounting checks) and the HF reference.

A recorder wraps ``ModelRunner.forward_logits`` (and the ``prepare_inputs`` it calls) to
capture, per step and per request, the tokens computed, the positions fed to the model, the
blocks held and the logits of the token that was sampled.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import atlas_vlm.model_runner as model_runner_module
from atlas_vlm import LLM, SamplingParams

IMAGES = Path(__file__).resolve().parent / "data" / "images"
PIX = 28 * 28  # pixels per visual token (patch 14, merge 2)
SMALL = {"max_pixels": 64 * PIX}
MEDIUM = {"max_pixels": 256 * PIX}
MAX_MODEL_LEN = 2048
BLOCK_SIZE = 16
IMAGE_PAD, VISION_START = 151655, 151652
LOGITS_ATOL = 1e-4
CPU_FP32 = dict(device="cpu", dtype="float32")  # exactness is fp32 on CPU, like the HF reference


# ---- fixtures (import them into a test module to use them) ---------------------------------------
@pytest.fixture(scope="module")
def vl(tiny_models):
    folder, hf = tiny_models["qwen2_5_vl"]
    return folder, hf.eval()


@pytest.fixture(scope="module")
def llm(vl):
    return LLM(str(vl[0]), max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=512, kvcache_block_size=BLOCK_SIZE,
               **CPU_FP32)


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
