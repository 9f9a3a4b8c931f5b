"""Helpers shared by the test folders (kv/, token_pipeline/, engine/, parity/): data paths,
step recorders (through ``ModelRunner.observers``, no patching), BlockManager accounting
helpers, a local HTTP server with slow answers, and the stage 4 (VLM) fixtures,
conversation builders and HF reference.

The recorders watch each forward through the runner's observer hook, which is called after
the forward and before the scheduler advances any request, so ``num_computed_tokens`` and the
block table are what the step saw.
"""

from __future__ import annotations

import asyncio
import http.server
import inspect
import math
import queue
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

from atlas_vlm import SamplingParams
from mm_kv_cache_management import BlockManager, RequestState, media_items

REPO = Path(__file__).resolve().parent.parent
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
        return torch.cat([r["positions"] for r in recs], dim=-1), recs[0]["start"]


@contextmanager
def record(llm):
    """Record every forward of ``llm``'s runner into a ``Recorder`` while the block runs."""
    runner = llm.engine.runner
    rec = Recorder()

    def observe(chunks, inp, logits, sampled):
        infos = [dict(rid=req.request_id, start=req.num_computed_tokens, end=req.num_computed_tokens + n,
                      num_prompt=req.num_prompt_tokens, rope_delta=req.rope_delta,
                      blocks=list(req.block_table.block_ids), req=req, step=len(rec.steps), logits=None)
                 for req, n in chunks]
        positions = inp.positions.cpu()
        offset = 0
        for info in infos:
            n = info["end"] - info["start"]
            info["positions"] = positions[..., offset:offset + n].clone()  # [3, n] M-RoPE or [n] RoPE
            offset += n
        for row, index in enumerate(sampled):
            infos[index]["logits"] = logits[row].detach().float().cpu().clone()
        for info in infos:
            rec.by_request.setdefault(info["rid"], []).append(info)
        rec.steps.append(infos)

    runner.observers.append(observe)
    try:
        yield rec
    finally:
        runner.observers.remove(observe)


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
IMAGE_PAD_ID, VIDEO_PAD_ID = 151655, 151656  # Qwen's <|image_pad|>, <|video_pad|>


def mm_token_type_ids(ids: torch.Tensor) -> torch.Tensor:
    """transformers 5's ``mm_token_type_ids`` of Qwen ids ``[batch, n]``: 0 text, 1 image, 2 video
    (what ``Qwen2_5_VLProcessor`` returns and ``get_rope_index`` reads)."""
    return (ids == IMAGE_PAD_ID).int() + 2 * (ids == VIDEO_PAD_ID).int()


def hf_inputs(p):
    """HF ``generate`` / forward inputs of one ``ProcessedPrompt``: SmolVLM's tiles and video
    frames stacked in prompt order (its ``inputs_merger`` fills the ``<image>`` runs in that
    order); Qwen's images and videos apart, with Qwen2.5-VL's ``second_per_grid_ts``."""
    ids = torch.tensor([p.prompt_token_ids])
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    items = p.mm_items
    if items and hasattr(items[0], "pixel_attention_mask"):  # SmolVLM: one item per tile / frame
        kwargs["pixel_values"] = torch.stack([t.pixel_values for t in items])[None]  # [1, items, 3, H, W]
        kwargs["pixel_attention_mask"] = torch.stack([t.pixel_attention_mask for t in items])[None]
        return kwargs
    if p.images:
        kwargs["pixel_values"] = torch.cat([im.pixel_values for im in p.images])
        kwargs["image_grid_thw"] = torch.tensor([list(im.grid_thw) for im in p.images])
    if p.videos:
        kwargs["pixel_values_videos"] = torch.cat([v.pixel_values for v in p.videos])
        kwargs["video_grid_thw"] = torch.tensor([list(v.grid_thw) for v in p.videos])
        kwargs["second_per_grid_ts"] = torch.tensor([v.second_per_grid_t for v in p.videos])
    if items:
        kwargs["mm_token_type_ids"] = mm_token_type_ids(ids)
    return kwargs


def drop_unused(hf, kwargs: dict) -> dict:
    """``kwargs`` without ``second_per_grid_ts`` for the families whose forward has none."""
    if "second_per_grid_ts" in kwargs and "second_per_grid_ts" not in inspect.signature(hf.forward).parameters:
        kwargs = {k: v for k, v in kwargs.items() if k != "second_per_grid_ts"}
    return kwargs


@torch.no_grad()
def hf_reference(hf, p, n_tokens):
    """HF greedy tokens, first-step logits (plain forward) and per-step generate logits."""
    kwargs = drop_unused(hf, hf_inputs(p))
    first = hf(**kwargs).logits[0, -1].float()
    gen = hf.generate(**kwargs, max_new_tokens=n_tokens, do_sample=False, output_logits=True,
                      return_dict_in_generate=True, pad_token_id=151643)
    tokens = gen.sequences[0, kwargs["input_ids"].shape[1]:].tolist()
    return tokens, first, [s[0].float() for s in gen.logits]


def assert_rope_matches_hf(hf, p):
    """MAC-V3: our prompt positions and rope_delta equal HF ``get_rope_index``."""
    kwargs = hf_inputs(p)
    # keywords: Qwen2.5-VL's signature has second_per_grid_ts, Qwen2-VL's and Qwen3-VL's do not
    extra = {"second_per_grid_ts": kwargs["second_per_grid_ts"]} if "second_per_grid_ts" in kwargs and \
        "second_per_grid_ts" in inspect.signature(hf.model.get_rope_index).parameters else {}
    pos, delta = hf.model.get_rope_index(kwargs["input_ids"], mm_token_type_ids(kwargs["input_ids"]),
                                         image_grid_thw=kwargs.get("image_grid_thw"),
                                         video_grid_thw=kwargs.get("video_grid_thw"),
                                         attention_mask=kwargs["attention_mask"], **extra)
    assert p.mrope_positions.shape == (3, len(p.prompt_token_ids))
    assert torch.equal(p.mrope_positions.long(), pos[:, 0].long())
    assert p.rope_delta == int(delta.reshape(-1)[0])


def assert_matches_hf(llm, hf, conversation, out, rec, n_tokens, mm_options=None):
    """MAC-V1 + MAC-V3 for one request of a recorded call."""
    p = llm.engine.process_prompt({"messages": conversation, "mm_options": mm_options})
    assert out.finish_reason in ("length", "stop") and out.error is None
    assert out.prompt_token_ids == p.prompt_token_ids
    fed, start = rec.prefill_positions(out.request_id)
    if p.mrope_positions is not None:
        assert_rope_matches_hf(hf, p)
        # positions actually fed to the model during prefill are those of get_rope_index
        assert torch.equal(fed, p.mrope_positions[:, start:].long())
    else:  # 1-D RoPE (SmolVLM): token index
        assert torch.equal(fed, torch.arange(start, len(p.prompt_token_ids)))
    tokens, first, step_logits = hf_reference(hf, p, n_tokens)
    assert out.token_ids == tokens
    torch.testing.assert_close(rec.first_logits(out.request_id), first, atol=LOGITS_ATOL, rtol=0)
    ours = rec.sampled_logits(out.request_id)
    assert len(ours) == len(step_logits) == len(tokens)
    for step, (a, b) in enumerate(zip(ours, step_logits)):
        torch.testing.assert_close(a, b, atol=LOGITS_ATOL, rtol=0, msg=lambda m: f"step {step}: {m}")
    # decode positions: context_len + rope_delta of this request, on all three axes (M-RoPE)
    for r in rec.by_request[out.request_id]:
        if r["start"] >= r["num_prompt"]:
            expect = torch.arange(r["start"], r["end"]) + p.rope_delta
            assert torch.equal(r["positions"], expect[None].expand(3, -1) if p.mrope_positions is not None else expect)
    return p


def assert_preempted_match_hf(llm, hf, convs, outs, rec, n_tokens, mm_options=None):
    """After a run with preemption: every request's greedy tokens equal HF ``generate`` and
    every sampled step's logits (the recompute's included) within ``LOGITS_ATOL``; at least
    one request was recomputed from its start."""
    assert llm.engine.scheduler.num_preemptions >= 1
    for c, out in zip(convs, outs):
        p = llm.engine.process_prompt({"messages": c, "mm_options": mm_options})
        tokens, _, step_logits = hf_reference(hf, p, n_tokens)
        assert out.token_ids == tokens
        ours = rec.sampled_logits(out.request_id)  # one row per generated token, recompute included
        assert len(ours) == len(step_logits) == n_tokens
        for a, b in zip(ours, step_logits):
            torch.testing.assert_close(a, b, atol=LOGITS_ATOL, rtol=0)
    preempted = [rid for rid, recs in rec.by_request.items() if sum(r["start"] == 0 for r in recs) > 1]
    assert preempted, "no request was recomputed from its start"


# ---- StepRecorder (text and engine tests) -----------------------------------------------------
class StepRecorder:
    """Context manager recording what each engine step computed:

    - ``logits[request_id]``: a clone of every sampled logits row of that request (fp32,
      ``[vocab]``), in step order;
    - ``chunks[request_id]``: per forward that request took part in,
      ``(num_computed_tokens_before, num_new_tokens, tuple(block_ids))`` as the step saw them;
    - ``steps``: one entry per forward, the list of
      ``(request_id, num_computed_tokens_before, num_new_tokens, tuple(block_ids))`` of its
      chunks in batch order.
    """

    def __init__(self, llm):
        self.runner = llm.engine.runner
        self.logits: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.chunks: dict[str, list[tuple[int, int, tuple[int, ...]]]] = defaultdict(list)
        self.steps: list[list[tuple[str, int, int, tuple[int, ...]]]] = []

    def _observe(self, chunks, inp, logits, sampled) -> None:
        step = [(req.request_id, req.num_computed_tokens, n, tuple(req.block_table.block_ids))
                for req, n in chunks]
        self.steps.append(step)
        for rid, computed, n, table in step:
            self.chunks[rid].append((computed, n, table))
        for row, i in enumerate(sampled):
            self.logits[chunks[i][0].request_id].append(logits[row].clone())

    def __enter__(self) -> StepRecorder:
        self.runner.observers.append(self._observe)
        return self

    def __exit__(self, *exc) -> None:
        self.runner.observers.remove(self._observe)


# ---- BlockManager accounting (kv/ tests) ------------------------------------------------------
def make_req(rid: str, num_tokens: int, start: int = 0, mm_positions=None) -> RequestState:
    """A request whose token ids are ``start, start+1, ...`` (distinct starts: no shared prefix)."""
    return RequestState(rid, list(range(start, start + num_tokens)), mm_features=media_items(list(mm_positions or [])))


def ref_counts(bm: BlockManager) -> list[int]:
    return [b.ref_count for b in bm.blocks]


def snapshot(bm: BlockManager, reqs) -> tuple:
    """Everything an allocation could touch, by value."""
    return (
        bm.num_free_blocks,
        list(bm._free),
        ref_counts(bm),
        [b.block_hash for b in bm.blocks],
        dict(bm._cached),
        [
            None
            if r.block_table is None
            else (list(r.block_table.block_ids), r.block_table.num_tokens, r.num_computed_tokens, r.num_cached_tokens)
            for r in reqs
        ],
    )


def compute_all(bm: BlockManager, req: RequestState) -> None:
    """What the scheduler does after a forward pass: every token's K/V now stored, full blocks cached."""
    bm.commit_computed(req, req.num_tokens - req.num_computed_tokens)


# ---- a local HTTP server with slow and oversized answers (image download limits) -------------
class SlowHandler(http.server.BaseHTTPRequestHandler):
    """``/drip-body``: headers, then 1 byte every 0.5 s (40 at most); ``/drip-headers``: the
    status line 1 byte every 0.5 s; ``/big``: 5000 bytes, declared; ``/big-undeclared``: 5000
    bytes, no Content-Length; anything else: a file of ``IMAGES``. ``server.drips`` gets
    ``(path, bytes sent, finished)`` when a drip ends (finished False: the client hung up)."""

    protocol_version = "HTTP/1.0"

    def log_message(self, *args):
        pass

    def _drip(self, payload: bytes) -> None:
        sent = 0
        try:
            for byte in payload[:40]:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                sent += 1
                time.sleep(0.5)
        except OSError:
            self.server.drips.put((self.path, sent, False))
            return
        self.server.drips.put((self.path, sent, True))

    def do_GET(self):
        if self.path == "/drip-headers":
            return self._drip(b"HTTP/1.0 200 OK\r\nX-Slow: " + b"a" * 64)
        if self.path == "/drip-body":
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            return self._drip(b"x" * 1000)
        if self.path in ("/big", "/big-undeclared"):
            self.send_response(200)
            if self.path == "/big":
                self.send_header("Content-Length", "5000")
            self.end_headers()
            self.wfile.write(b"y" * 5000)
            return None
        path = IMAGES / self.path.lstrip("/")
        if not path.is_file():
            self.send_error(404)
            return None
        data = path.read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        return None


@contextmanager
def slow_http_server():
    """Yield ``(base_url, server)`` of a ``SlowHandler`` server on 127.0.0.1 (a daemon thread)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SlowHandler)
    server.drips = queue.Queue()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server
    finally:
        server.shutdown()
        server.server_close()


# ---- quantized kernels -------------------------------------------------------------------------
def require_quant_kernel(what: str = "this check") -> None:
    """Skip (naming why) unless the quantized matmul kernel (``kernels/csrc/quant_gemm.c``)
    is built here. It builds on any CPU with a C compiler (``$CC``, ``cc`` or ``gcc``), in the
    variant the CPU runs (AVX512-VNNI, AVX2 with or without AVX-VNNI, plain C); without one the
    engine uses the dequantized reference. Asks ``quant_kernel.available()``, not
    ``quant_linear.quant_kernel_available``, which tests patch to fake either answer."""
    from atlas_vlm.kernels import quant_kernel

    if not quant_kernel.available():
        import pytest

        pytest.skip(f"{what} needs the quantized matmul kernel, which did not build here (no C compiler: "
                    f"$CC, cc or gcc; or the build failed, see the log); the engine then uses the reference")




def compiled_json_request(mgr, schema: dict, token_ids: list[int]):
    """A stand-in request (id "r") whose prompt is ``token_ids``, constrained to the JSON
    ``schema``, added to the StructuredOutputManager ``mgr`` and waited on (at most 50 s)
    until its grammar is compiled without error; returns it."""
    from types import SimpleNamespace

    from atlas_vlm.structured_output import StructuredOutputsParams

    req = SimpleNamespace(request_id="r", sampling_params=SimpleNamespace(structured_outputs=StructuredOutputsParams(
        json=schema)), token_ids=list(token_ids), num_prompt_tokens=len(token_ids), num_computed_tokens=0,
        spec_token_ids=[])
    assert mgr.add_request(req)
    for _ in range(500):
        ready, error = mgr.poll_compiled(req)
        if ready:
            break
        mgr.wait_for_compiles(0.1)
    assert ready and error is None
    return req


def run_async(coro, limit_s: float = 120):
    """Run ``coro`` to completion in a fresh event loop on its own thread, bounded by
    ``limit_s`` seconds (a hang, not slowness, fails): the coroutine's value."""
    result = {}

    def target():
        result["value"] = asyncio.run(asyncio.wait_for(coro, limit_s))

    t = threading.Thread(target=target)
    t.start()
    t.join(limit_s + 10)
    assert not t.is_alive(), "hung"
    return result["value"]
