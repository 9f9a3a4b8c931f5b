"""Qwen3.5 decode throughput (issue 25): our engine with 16 and 64 requests at once vs HF
``generate`` one request at a time, on the same random-weight model, prompts and lengths.

The model: a random ``Qwen3_5ForCausalLM`` with the shapes of Qwen3.5-0.8B's decoder scaled
down so a run takes a couple of minutes on 2 cores (nothing downloaded): every width / 4
(hidden 1024 -> 256, MLP 3584 -> 896, head dims 256 -> 64 full and 128 -> 32 linear), head
counts kept (8 query / 2 KV heads; 16 key / 16 value Gated DeltaNet heads; conv kernel 4),
layers 24 -> 8 in the same 3:1 pattern (6 Gated DeltaNet, 2 gated full attention), vocabulary
248,320 -> 16,384, partial rotary 0.25 with interleaved M-RoPE (11, 11, 10 -> 3, 3, 2), tied
embeddings. Saved once to a temporary folder with the Qwen tokenizer.

Requests: seeded random token-id prompts (16..64 tokens) and ``max_tokens`` (24..48; 32..64 in
a full run), greedy, EOS ignored, so each request makes exactly its ``max_tokens``. Throughput:
output tokens / wall seconds of the whole run (prefill included; prompts are short). HF runs
one request after another (its per-token cost does not depend on the request count), over the
first ``hf_requests`` requests; its rate stands for both batch sizes. Greedy tokens of ours (at
each batch size) are compared with HF's on those requests. Both in the bench dtype. On a
shared machine run it with ``--threads 1`` (OpenMP waits slow HF's many small ops 10x and more).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from benchmarks.common import compare_tokens, dtype_name, log, markdown_table, match_str, now, random_prompts, section

VOCAB = 16_384
TARGET = 3.0  # issue 25: ours at 16 and 64 requests >= 3x HF generate one at a time


def config():
    """The scaled-down Qwen3.5-0.8B text config described in the module docstring."""
    from transformers import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=896, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4, max_position_embeddings=4096,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                             mrope_section=[3, 3, 2], mrope_interleaved=True),
        bos_token_id=None, eos_token_id=None)  # EOS is ignored; Qwen's ids lie outside this vocabulary
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    return cfg


def build(folder: Path, dtype: torch.dtype):
    """Save the random model (seed 0, fp32) + the Qwen tokenizer to ``folder``; returns the HF
    model in ``dtype`` (eval)."""
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM

    from atlas_vlm.models.qwen2_vl.tokenizer_files import qwen_tokenizer_dir

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3_5ForCausalLM(config()).eval()
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(qwen_tokenizer_dir()).save_pretrained(folder)
    return model.to(dtype)


@torch.inference_mode()
def hf_one_at_a_time(model, prompts, outs) -> tuple[float, list[list[int]]]:
    """HF ``generate`` per request, greedy, exactly ``n`` new tokens. Returns (seconds, ids)."""
    toks, t0 = [], now()
    for p, n in zip(prompts, outs):
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=0)
        toks.append(out[0, len(p):].tolist())
    return now() - t0, toks


def ours(llm, prompts, outs) -> tuple[float, list[list[int]]]:
    """All requests in one ``LLM.generate`` call. Returns (seconds, ids)."""
    from atlas_vlm import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outs]
    t0 = now()
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return now() - t0, [r.token_ids for r in res]


def run(quick: bool = False, dtype: torch.dtype = torch.float32) -> dict:
    """Print and return ``{"hf": {...}, "batches": {16: {...}, 64: {...}}, "target": 3.0}``:
    tokens, seconds, tok/s, ratio to HF one at a time, greedy agreement with HF."""
    import random

    from atlas_vlm import LLM

    hf_requests = 8 if quick else 16
    lo, hi = (24, 48) if quick else (32, 64)
    prompts = random_prompts(64, 16, 64, (100, VOCAB), seed=25)
    rng = random.Random(26)
    outs = [rng.randint(lo, hi) for _ in prompts]
    section(f"Qwen3.5 decode (random Qwen3.5-0.8B shapes scaled down: hidden 256, 8 layers, vocab {VOCAB:,}), "
            f"{dtype_name(dtype)}, {torch.get_num_threads()} threads: ours at 16 / 64 requests vs HF generate "
            "one at a time")
    with tempfile.TemporaryDirectory(prefix="bench_qwen3_5_") as tmp:
        hf = build(Path(tmp), dtype)
        log(f"HF generate, {hf_requests} requests one at a time")
        hf_generate = lambda: hf_one_at_a_time(hf, prompts[:1], [4])  # noqa: E731  warm-up
        hf_generate()
        t_hf, ref = hf_one_at_a_time(hf, prompts[:hf_requests], outs[:hf_requests])
        hf_rate = sum(outs[:hf_requests]) / t_hf
        llm = LLM(tmp, dtype=dtype_name(dtype), device="cpu", max_model_len=256, max_num_seqs=64,
                  kv_cache_memory=256 << 20)
        ours(llm, prompts[:4], [4] * 4)  # warm-up
        res = {"hf": {"requests": hf_requests, "tokens": sum(outs[:hf_requests]), "seconds": t_hf, "tok_s": hf_rate},
               "batches": {}, "target": TARGET}
        rows = [["HF generate, one at a time", hf_requests, sum(outs[:hf_requests]), f"{t_hf:.1f}",
                 f"{hf_rate:.1f}", "1.00x", "-"]]
        for batch in (16, 64):
            log(f"ours, {batch} requests")
            t, ids = ours(llm, prompts[:batch], outs[:batch])
            rate = sum(outs[:batch]) / t
            cmp = compare_tokens(ids[:hf_requests], ref)
            res["batches"][batch] = {"tokens": sum(outs[:batch]), "seconds": t, "tok_s": rate,
                                     "ratio": rate / hf_rate, "met": rate / hf_rate >= TARGET, "vs_hf": cmp}
            rows.append([f"ours, {batch} at once", batch, sum(outs[:batch]), f"{t:.1f}", f"{rate:.1f}",
                         f"{rate / hf_rate:.2f}x", match_str(cmp)])
    print(markdown_table(["system", "requests", "out tokens", "seconds", "tok/s", "vs HF", "greedy = HF"], rows))
    print(f"target: ours >= {TARGET:g}x HF at 16 and 64 requests: "
          + ", ".join(f"{b}: {'met' if r['met'] else 'NOT met'}" for b, r in res["batches"].items()))
    return res


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    run(quick=p.parse_args().quick)
