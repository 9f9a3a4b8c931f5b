"""KV memory in tiers (issue 27), in one process: the 8-bit KV cache and the disk tier.

- Tokens per pool: blocks that ``kv_cache_memory`` holds with ``kv_cache_dtype`` int8 vs
  ``auto`` (the bench dtype), from the engine's own allocation.
- Decode at batch 32 on SmolLM2-135M: tok/s with int8 K/V over tok/s with ``auto``, both
  engines alive at once and run in alternating rounds (3 quick, 5 full); the ratio is the
  median of the rounds' time ratios (one wall-clock run each swung 0.6x-3.1x on a shared machine).
- A 4,000-token chat evicted from a small pool and asked again: TTFT with the disk tier
  (``kv_cache_dir``) over a full re-prefill (prefix caching off), tokens compared.
- A restart: the same image + question on a NEW engine over the same ``kv_cache_dir``, TTFT vs
  a cold engine (the embedded random-weight Qwen2.5-VL; the photo resized to 896 x 896 =
  1024 * 28 * 28 pixels, 1,024 visual tokens), tokens compared.
TTFT here is the wall time to a streamed request's first output (8 tokens compared). Units: seconds, tokens.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks.common import dtype_name, log, markdown_table, now, section

FILLER = "The committee reviewed each proposal in turn, noting costs, risks and the schedule. "


def _ttft(llm, prompt, chat: bool = False) -> tuple[float, list[int]]:
    from atlas_vlm import SamplingParams

    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    t0, first, tokens = now(), None, []
    stream = llm.chat(prompt, p, stream=True) if chat else llm.generate(prompt, p, stream=True)
    for out in stream:  # the time to the first output, then the rest (8 tokens compared)
        first = now() - t0 if first is None else first
        tokens = out.token_ids
    return first, tokens


def _int8(dtype: str, quick: bool) -> dict:
    from atlas_vlm import LLM, SamplingParams
    from atlas_vlm.default_models import default_text_model

    res = {}
    prompts = [f"Question {i}: describe the history of city number {i} in a few sentences." for i in range(32)]
    params = SamplingParams(temperature=0, max_tokens=32 if quick else 64, ignore_eos=True)
    llms = {kv: LLM(default_text_model(), dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=256 << 20, max_num_seqs=32)
            for kv in ("auto", "int8")}
    for llm in llms.values():  # warm-up (kernel builds, first allocations)
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    # the two caches in alternating rounds, so load on a shared machine falls on both alike;
    # the ratio is the median of the rounds' ratios, tok/s each cache's best round
    rounds, times = 3 if quick else 5, {kv: [] for kv in llms}
    for _ in range(rounds):
        for kv, llm in llms.items():
            t0 = now()
            outs = llm.generate(prompts, params, use_tqdm=False)
            times[kv].append(now() - t0)
    tokens = sum(len(o.token_ids) for o in outs)
    for kv, llm in llms.items():
        res[kv] = {"blocks": llm.engine.block_manager.num_blocks, "seconds": min(times[kv]),
                   "tok_s": tokens / min(times[kv])}
    ratios = sorted(a / b for a, b in zip(times["auto"], times["int8"]))
    res["tokens_ratio"] = res["int8"]["blocks"] / res["auto"]["blocks"]
    res["decode_ratio"] = ratios[len(ratios) // 2]
    return res


def _evicted_chat(dtype: str, quick: bool) -> dict:
    from atlas_vlm import LLM
    from atlas_vlm.default_models import default_text_model

    n_words = 1500 if quick else 3000  # ~2,000 / ~4,000 tokens
    long = (FILLER * (n_words // 14 + 1))[: n_words * 6] + "\nSummarize the discussion above in one sentence."
    kw = dict(dtype=dtype, max_model_len=8192, kvcache_block_size=16)
    cold = LLM(default_text_model(), enable_prefix_caching=False, **kw)
    t_cold, ref = _ttft(cold, long)
    tokens = len(cold.engine.process_prompt(long).prompt_token_ids)
    with tempfile.TemporaryDirectory() as kv_dir:
        blocks = -(-tokens // 16) + 8  # the pool holds this chat and little more
        llm = LLM(default_text_model(), kv_cache_dir=kv_dir, num_kvcache_blocks=blocks, **kw)
        _ttft(llm, long)
        for i in range(2):  # other chats push its blocks out of the pool
            _ttft(llm, f"Unrelated request {i}. " + FILLER * (n_words // 28))
        t_disk, out = _ttft(llm, long)
    return {"prompt_tokens": tokens, "cold_s": t_cold, "disk_s": t_disk, "speedup": t_cold / t_disk,
            "identical": out == ref}


def _restart_image(dtype: str) -> dict:
    from atlas_vlm import LLM
    from atlas_vlm.default_models import default_vlm_model
    from PIL import Image

    from benchmarks.common import IMAGE_DIRS

    image = next(p for d in IMAGE_DIRS if d.is_dir() for p in sorted(d.glob("*.jpg")))
    kw = dict(dtype=dtype, max_model_len=4096, max_pixels=1024 * 28 * 28)
    with tempfile.TemporaryDirectory() as kv_dir:
        # the photo at 896 x 896 = 1024 * 28 * 28 pixels: 1,024 visual tokens (the photos are smaller)
        sized = Path(kv_dir) / f"{image.stem}_896.png"
        Image.open(image).convert("RGB").resize((896, 896), Image.BICUBIC).save(sized)
        conv = [{"role": "user", "content": [{"type": "image", "image": str(sized)},
                                             {"type": "text", "text": "Describe this picture in detail."}]}]
        t_cold, ref = _ttft(LLM(default_vlm_model(), enable_prefix_caching=False, **kw), conv, chat=True)
        _ttft(LLM(default_vlm_model(), kv_cache_dir=str(Path(kv_dir) / "kv"), **kw), conv, chat=True)  # fills it
        restarted = LLM(default_vlm_model(), kv_cache_dir=str(Path(kv_dir) / "kv"), **kw)
        t_warm, out = _ttft(restarted, conv, chat=True)
    return {"image": image.name, "cold_s": t_cold, "restart_s": t_warm, "speedup": t_cold / t_warm,
            "identical": out == ref}


def run(quick: bool = False, dtype=None) -> dict:
    name = dtype_name(dtype) if dtype is not None else "auto"
    section(f"KV tiers: 8-bit KV cache and the disk tier ({name})")
    log("int8 vs auto K/V: pool tokens, decode at batch 32")
    res = {"int8": _int8(name, quick)}
    log("a long chat evicted, asked again (disk tier vs re-prefill)")
    res["evicted_chat"] = _evicted_chat(name, quick)
    log("image + question after a restart (disk tier vs cold)")
    res["restart_image"] = _restart_image(name)
    i8, chat, img = res["int8"], res["evicted_chat"], res["restart_image"]
    print(markdown_table(["measure", "value", "target"], [
        ["int8 K/V: tokens in the same pool bytes / auto", f"{i8['tokens_ratio']:.2f}x", ">= 1.9x"],
        ["decode at batch 32: int8 / auto tok/s", f"{i8['decode_ratio']:.2f}x", ">= 0.9x"],
        [f"{chat['prompt_tokens']}-token chat evicted, asked again: re-prefill / disk-tier TTFT "
         f"(identical: {chat['identical']})", f"{chat['speedup']:.1f}x", ">= 3x"],
        [f"image + question after a restart: cold / restarted TTFT (identical: {img['identical']})",
         f"{img['speedup']:.1f}x", ">= 5x"],
    ]))
    return res
