"""One system on one GGUF file, in its own process (so its peak RSS is its own):
``python -m benchmarks.chain_worker ours|llama.cpp FILE [--quick] [--threads N] [--quantization Q]
[--agree] [--chat-ids JSON]`` prints one JSON line.

Measured (same ids for both systems, greedy, EOS ignored): the load (seconds from the call to
a model ready for requests: ``LLM(FILE)`` / ``llama_cpp.Llama(FILE)``; the caller warms the page
cache first), one stream of ``N`` new tokens (128; decode tok/s = (N - 1) / (last token time -
first token time), warm-up once, best of 2), time to first token of one 512- and one 2,048-token
prompt (best of 2), ``R`` mixed requests (16 and 64: prompts of 32-512 ids, 16-128 new tokens;
ours batched in one ``generate``, llama.cpp's binding one after another), the process's RSS
after its imports (``import_rss_bytes``: torch's share on both sides, since this module imports
it) and its peak RSS (bytes). ``--quick``: 32 new tokens, 512-token prefill only, 8 mixed
requests. Ours also reports its KV cache's bytes (``kv_bytes``), the part of its peak RSS the
memory target adds to the file size.

Threads: ``--threads`` (default torch's count, i.e. ``OMP_NUM_THREADS`` set by the caller) for
both sides: ``LLM(num_threads=N)``, llama.cpp's ``n_threads`` and ``n_threads_batch``; reported.
Ours loads the file as a user would, ``LLM(FILE)`` with no quantization named, unless
``--quantization`` names one.

``--agree`` (ours): three chat prompts (``CHAT``) rendered by our chat template, 128 greedy
tokens each; their prompt ids and tokens are returned (``chat``) so that the caller can hand the
same ids to llama.cpp (``--chat-ids``: a JSON list of id lists) and compare.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys

import torch

from benchmarks import llamacpp
from benchmarks.common import best_of, now, random_prompts
from benchmarks.text import _best, _ours

VOCAB = (100, 150000)  # ids drawn from the Qwen2.5 vocabulary
AGREE_TOKENS = 128
CHAT = ["Write a Python function that merges two sorted lists into one sorted list, with a docstring "
        "and two doctest examples.",
        "Explain the difference between a process and a thread, and when a program should use each.",
        "Here is a bug report: 'Saving a file with a name that contains a slash crashes the editor.' "
        "Suggest three likely causes and how to test each."]


def mixed(num: int, seed: int = 3) -> tuple[list[list[int]], list[int]]:
    """``num`` prompts of 32-512 random ids and their new-token counts (16-128)."""
    rng = random.Random(seed)
    return random_prompts(num, 32, 512, VOCAB, seed), [rng.randint(16, 128) for _ in range(num)]


def _progress(out: dict, what: str) -> None:
    """One progress line on stderr (the figure just measured), for a run watched by hand."""
    print(f"chain_worker {out['system']}: {what}", file=sys.stderr, flush=True)


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _load_ours(path: str, threads: int, quantization: str | None):
    from atlas_vlm import LLM

    return LLM(path, num_threads=threads, max_model_len=2560, max_num_batched_tokens=2048, num_kvcache_blocks=2048,
               enable_prefix_caching=False, **({"quantization": quantization} if quantization else {}))


def _agree_ours(llm) -> list[dict]:
    from atlas_vlm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=AGREE_TOKENS, ignore_eos=True)
    outs = [llm.chat([{"role": "user", "content": c}], params, use_tqdm=False)[0] for c in CHAT]
    return [{"prompt_ids": list(o.prompt_token_ids), "tokens": list(o.token_ids)} for o in outs]


def measure(system: str, path: str, quick: bool, threads: int | None = None, quantization: str | None = None,
            agree: bool = False, chat_ids: list[list[int]] | None = None) -> dict:
    """The figures above for ``system`` ("ours" or "llama.cpp") on the GGUF ``path``."""
    n, prefills, counts = (32, (512,), (8,)) if quick else (128, (512, 2048), (16, 64))
    ids = random_prompts(1, 24, 24, VOCAB, seed=1)[0]
    threads = threads or torch.get_num_threads()
    out = {"system": system, "threads": threads, "import_rss_bytes": _rss()}
    if system == "ours":
        from atlas_vlm import SamplingParams

        t0 = now()
        llm = _load_ours(path, threads, quantization)
        out["load_s"] = now() - t0
        out["threads"] = torch.get_num_threads()  # what the engine really set
        out["quantization"] = llm.engine.config.model_config.quantization
        out["kernel"] = llm.engine.runner.decode_step is not None
        out["kv_bytes"] = llm.engine.runner.kv_cache.nbytes
        _progress(out, f"loaded in {out['load_s']:.1f} s ({out['quantization']}, {out['threads']} threads)")
        stream = lambda: _ours(llm, ids, n)  # noqa: E731

        def first_token(p):
            llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                         use_tqdm=False)

        def batch(prompts, outs):
            params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in outs]
            t0 = now()
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return now() - t0
        if agree:
            out["chat"] = _agree_ours(llm)
            _progress(out, "chat prompts done")
    else:
        t0 = now()
        lcpp = llamacpp.load(path, n_ctx=2560, threads=threads)
        out["load_s"] = now() - t0
        _progress(out, f"loaded in {out['load_s']:.1f} s ({threads} threads)")
        stream = lambda: llamacpp.stream(lcpp, ids, n)  # noqa: E731
        first_token = lambda p: llamacpp.stream(lcpp, p, 1)  # noqa: E731
        batch = lambda prompts, outs: llamacpp.sequential(lcpp, prompts, outs)[0]  # noqa: E731
        if chat_ids:
            out["chat"] = [{"prompt_ids": p, "tokens": llamacpp.stream(lcpp, p, AGREE_TOKENS)["tokens"]}
                           for p in chat_ids]
            _progress(out, "chat prompts done")
    r = _best(stream, 2)
    out["decode_tok_s"], out["tokens"] = (n - 1) / r["decode_s"], r["tokens"]
    _progress(out, f"decode {out['decode_tok_s']:.1f} tok/s")
    for T in prefills:
        p = random_prompts(1, T, T, VOCAB, seed=7)[0]
        out[f"ttft_{T}_s"] = best_of(lambda: first_token(p), 2)[0]
        _progress(out, f"TTFT {T}: {out[f'ttft_{T}_s']:.2f} s")
    for num in counts:
        prompts, outs = mixed(num)
        seconds = batch(prompts, outs)
        out[f"mixed_{num}_s"], out[f"mixed_{num}_tok_s"] = seconds, sum(outs) / seconds
        _progress(out, f"{num} mixed: {out[f'mixed_{num}_tok_s']:.1f} tok/s")
    out["peak_rss_bytes"] = _rss()
    return out


def agreement(ours: list[int], ref: list[int]) -> dict:
    """Greedy agreement of two token lists: positions equal, the first index where they part
    (None: equal throughout) and the compared length."""
    same = sum(a == b for a, b in zip(ours, ref))
    parting = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    if parting is None and len(ours) != len(ref):
        parting = min(len(ours), len(ref))
    return {"equal": same, "of": max(len(ours), len(ref)), "first_parting": parting}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("system", choices=["ours", "llama.cpp"])
    p.add_argument("path")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quantization", default=None)
    p.add_argument("--agree", action="store_true")
    p.add_argument("--chat-ids", default=None, help="a JSON file: the chat prompts' ids (from ours' --agree)")
    a = p.parse_args()
    chat = json.load(open(a.chat_ids)) if a.chat_ids else None
    print(json.dumps(measure(a.system, a.path, a.quick, a.threads, a.quantization, a.agree, chat)))
