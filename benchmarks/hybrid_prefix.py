"""Prefix caching on a hybrid model (Qwen3.5's Gated DeltaNet layers: state snapshots at block
boundaries, ``mm_kv_cache_management/state_snapshots.py``), in one process.

A random Qwen3.5 VLM with the shapes of ``Qwen3.5-0.8B`` scaled down (8 layers, 3 of every 4
Gated DeltaNet; hidden 256; Qwen's real vocabulary and the released tower geometry: patch 16,
merge 2) gets a ~2,000-token shared prefix: a long system prompt + one image (~400 visual
tokens). TTFT (wall time of a ``max_tokens=1`` request) of a new question after that prefix on
an engine that has seen it (a hit: resumes from the last snapshot) vs the same request on an
engine with prefix caching off (a miss: the whole prompt); the tokens of both (8 greedy) must be
equal. fp32 whatever the bench dtype, so equal tokens mean exactness, not luck with rounding.
Units: seconds, tokens.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks.common import IMAGE_DIRS, log, markdown_table, now, section

SYSTEM = ("You are a careful assistant for a museum archive. Every answer cites the catalogue entry, the "
          "room and the shelf, and says when a record is uncertain or was restored. ")
IMAGE_PIXELS = 400 * 32 * 32  # ~400 visual tokens (patch 16, merge 2: 32 x 32 pixels per token)


def build(folder: Path) -> None:
    """Save the random scaled-down Qwen3.5-0.8B VLM (fp32) + Qwen's tokenizer to ``folder``."""
    import torch
    from transformers import AutoTokenizer, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from atlas_vlm.models.qwen2_vl.tokenizer_files import qwen_tokenizer_dir
    from atlas_vlm.models.qwen3_vl.vision import QWEN3_VL_CHAT_TEMPLATE

    text = dict(vocab_size=151936, hidden_size=256, intermediate_size=896, num_hidden_layers=8,
                num_attention_heads=4, num_key_value_heads=1, head_dim=64, linear_num_key_heads=4,
                linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
                max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645,
                layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
                rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                                     mrope_section=[3, 3, 2], mrope_interleaved=True))
    config = Qwen3_5Config(
        text_config=text, tie_word_embeddings=True,
        vision_config=dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=2, out_hidden_size=256,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
        architectures=["Qwen3_5ForConditionalGeneration"])
    torch.manual_seed(0)
    Qwen3_5ForConditionalGeneration(config).eval().save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)


def _conv(image: Path, system: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system},
            {"role": "user", "content": [{"type": "image", "image": str(image)}, {"type": "text", "text": question}]}]


def _ttft(llm, conv) -> tuple[float, list[int], tuple[int, int]]:
    """``(seconds to the first token, 8 greedy tokens, (prompt tokens served by the cache,
    prompt tokens))`` of the timed request; the 8 tokens come from running it again."""
    from atlas_vlm import SamplingParams

    seen = []
    llm.engine.runner.observers[:] = [
        lambda chunks, *_: seen.extend((r.num_cached_tokens, r.num_prompt_tokens) for r, _ in chunks)]
    t0 = now()
    llm.chat(conv, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    seconds = now() - t0
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    return seconds, out.token_ids, seen[0]


def run(quick: bool = False) -> dict:
    """The hit / miss TTFT ratio (target >= 3x) and whether the tokens are equal."""
    from atlas_vlm import LLM

    section("Hybrid prefix caching: Qwen3.5 state snapshots, TTFT of a hit vs a miss (fp32)")
    image = next(p for d in IMAGE_DIRS if d.is_dir() for p in sorted(d.glob("*.jpg")))
    system = SYSTEM * 48  # ~1,600 tokens of text before the image
    kw = dict(dtype="float32", device="cpu", max_model_len=4096, kvcache_block_size=16, max_pixels=IMAGE_PIXELS,
              kv_cache_memory=1 << 30, max_num_seqs=4)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "qwen3_5_small"
        log("building the random scaled-down Qwen3.5-0.8B VLM")
        build(folder)
        off = LLM(str(folder), enable_prefix_caching=False, **kw)
        on = LLM(str(folder), **kw)
        for llm in (off, on):  # warm both (first-call costs) on an unrelated prompt
            _ttft(llm, _conv(image, "Be brief.", "What is this?"))
        _ttft(on, _conv(image, system, "Describe the picture for the catalogue."))  # the cache sees the prefix
        question = _conv(image, system, "Which room should this item go to, and why?")
        t_miss, ref, _ = _ttft(off, question)
        t_hit, out, (cached, tokens) = _ttft(on, question)
        pool = on.engine.block_manager.state_snapshots
        res = {"cached_tokens": cached, "miss_s": t_miss, "hit_s": t_hit, "speedup": t_miss / t_hit,
               "identical": out == ref, "snapshot_hits": pool.hits, "snapshot_queries": pool.queries,
               "snapshot_interval": pool.interval, "prompt_tokens": tokens}
    print(markdown_table(["measure", "value", "target"], [
        [f"~2,000-token system prompt + image, new question: miss / hit TTFT ({cached} tokens from the cache; "
         f"identical tokens: {res['identical']})", f"{res['speedup']:.1f}x", ">= 3x"],
        ["miss TTFT / hit TTFT (s)", f"{t_miss:.3f} / {t_hit:.3f}", "-"],
    ]))
    return res
