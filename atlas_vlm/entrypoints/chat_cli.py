"""``atlas-vlm chat [MODEL]``: a multi-turn terminal chat (as ``llama-cli -cnv`` / ``ollama run``).

The answer streams as it is made (``LLM.chat(..., stream=True)``); lines are read with the stdlib
``readline`` (history in ``$ATLAS_VLM_CACHE/chat_history``, or ``--history-file``). Commands:
``/image PATH`` and ``/video PATH`` attach a file to the next user message, ``/system TEXT``, ``/clear``, ``/save FILE``
(the conversation as JSON messages), ``/help``, ``/exit``. Ctrl-C during an answer stops it (the
request is aborted, the partial answer stays in the history); Ctrl-C at the prompt, then a second
one, or Ctrl-D leaves with exit code 0. The model, engine and sampling flags are
``scripts/generate.py``'s (``generate_args``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from atlas_vlm.entrypoints.generate_args import (add_generation_args, check_image, check_video, engine_kwargs,
                                                 sampling_params, video_options)

HELP = """commands:
  /image PATH    attach an image to the next message (repeatable)
  /video PATH    attach a video to the next message (repeatable; --fps / --max-frames apply)
  /system TEXT   set the system message (empty TEXT: none)
  /clear         forget the conversation (the system message stays)
  /save FILE     write the conversation as JSON messages
  /help          this list
  /exit          leave (also Ctrl-D, or Ctrl-C twice at the prompt)
Ctrl-C during an answer stops it."""


def add_parser(subparsers) -> None:
    """Register ``atlas-vlm chat``."""
    p = subparsers.add_parser("chat", help="multi-turn chat in the terminal, answers streamed",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="HF model folder, .gguf file or Hub id ORG/NAME (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--system", default=None, help="system message of the conversation (also /system TEXT)")
    p.add_argument("--history-file", default=None, metavar="PATH",
                   help="readline history of the typed lines (default $ATLAS_VLM_CACHE/chat_history, "
                        "~/.cache/atlas_vlm/chat_history)")
    add_generation_args(p, model_flag=False)
    p.set_defaults(func=run)


def default_history_file() -> Path:
    """The readline history: ``$ATLAS_VLM_CACHE/chat_history`` (default ``~/.cache/atlas_vlm``)."""
    return Path(os.environ.get("ATLAS_VLM_CACHE", Path.home() / ".cache" / "atlas_vlm")) / "chat_history"


class ChatSession:
    """One conversation: the messages so far, the files waiting for the next user message, and
    the ``LLM`` that answers.

    Args:
        llm: an ``LLM`` (``chat(messages, params, stream=True)``).
        params: the ``SamplingParams`` of every answer.
        system: the system message, or None.
        video_opts: the keys added to each video item (``fps``, ``max_frames``).
    """

    def __init__(self, llm, params, system: str | None = None, video_opts: dict | None = None):
        self.llm, self.params, self.system = llm, params, system
        self.video_opts = video_opts or {}
        self.messages: list[dict] = []  # user / assistant turns, the system message not included
        self.attached: list[dict] = []  # content items for the next user message
        self._stop = False

    def conversation(self) -> list[dict]:
        """The system message (if any) and the turns, as OpenAI chat messages."""
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.messages

    def command(self, line: str) -> bool:
        """Run one ``/command`` line, printing its result; returns False on ``/exit``.

        Raises:
            ValueError: an unknown command, a missing argument, a bad file (the message names it).
        """
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        if name == "/exit":
            return False
        if name == "/help":
            print(HELP)
        elif name == "/clear":
            self.messages, self.attached = [], []
            print("(conversation cleared)")
        elif name == "/system":
            self.system = arg or None
            print("(system message set)" if arg else "(system message removed)")
        elif name in ("/image", "/video", "/save") and not arg:
            raise ValueError(f"{name} needs a path: {name} PATH")
        elif name == "/image":
            check_image(arg, "/image")
            self.attached.append({"type": "image", "image": arg})
            print(f"(image {arg} attached to the next message)")
        elif name == "/video":
            check_video(arg, "/video")
            self.attached.append({"type": "video", "video": arg, **self.video_opts})
            print(f"(video {arg} attached to the next message)")
        elif name == "/save":
            Path(arg).write_text(json.dumps(self.conversation(), indent=2, ensure_ascii=False) + "\n")
            print(f"(conversation saved to {arg})")
        else:
            raise ValueError(f"unknown command {name!r}; /help lists them")
        return True

    def _on_sigint(self, signum, frame) -> None:
        self._stop = True

    def answer(self, text: str) -> str:
        """Send ``text`` (with the attached files) as the next user message and stream the reply
        to stdout. Ctrl-C stops it between two steps: the request is aborted and the partial reply
        kept. Returns the finish reason ("stop", "length", "abort").

        Raises:
            ValueError, TypeError, OSError: the engine refused the message (neither it nor its
                attached files are kept).
        """
        content = [*self.attached, {"type": "text", "text": text}] if self.attached else text
        user = {"role": "user", "content": content}
        self.attached = []
        reply, finish = [], None
        self._stop = False
        previous = signal.signal(signal.SIGINT, self._on_sigint)  # no KeyboardInterrupt mid-step
        try:
            stream = self.llm.chat(self.conversation() + [user], self.params, stream=True)
            self.messages.append(user)
            try:
                for out in stream:
                    print(out.new_text, end="", flush=True)
                    reply.append(out.new_text)
                    finish = out.finish_reason
                    if self._stop and not out.finished:
                        stream.close()  # aborts the request
                        finish = "abort"
                        break
            except BaseException:
                self.messages.pop()
                raise
        finally:
            signal.signal(signal.SIGINT, previous)
        print()
        if finish == "abort":
            print("(answer stopped)", file=sys.stderr)
        self.messages.append({"role": "assistant", "content": "".join(reply)})
        return finish


def _setup_readline(path: Path):
    """Load the history from ``path`` (if the stdlib ``readline`` exists here); returns the module or None."""
    try:
        import readline
    except ImportError:  # not on every platform: plain input() then
        return None
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    readline.set_history_length(1000)
    return readline


def _save_history(readline, path: Path) -> None:
    if readline is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        readline.write_history_file(path)
    except OSError as exc:
        print(f"(history not saved: {exc})", file=sys.stderr)


def loop(session: ChatSession, prompt: str = ">>> ") -> int:
    """Read lines until ``/exit``, Ctrl-D or a second Ctrl-C at the prompt; returns 0."""
    interrupted = False
    while True:
        try:
            line = input(prompt)
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            if interrupted:
                print()
                return 0
            interrupted = True
            print("\n(Ctrl-C again, Ctrl-D or /exit to leave)")
            continue
        interrupted = False
        if not line.strip():
            continue
        try:
            if line.lstrip().startswith("/"):
                if not session.command(line):
                    return 0
            else:
                session.answer(line)
        except (ValueError, TypeError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Load the model and chat; returns the exit code (0 when the user leaves)."""
    from atlas_vlm import LLM
    from atlas_vlm.default_models import default_text_model

    kwargs, params = engine_kwargs(args), sampling_params(args)
    try:
        llm = LLM(args.model or default_text_model(), **kwargs)
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    session = ChatSession(llm, params, system=args.system, video_opts=video_options(args))
    history = Path(args.history_file) if args.history_file else default_history_file()
    readline = _setup_readline(history)
    print("atlas-vlm chat: /help for commands, Ctrl-D or /exit to leave", file=sys.stderr)
    try:
        return loop(session)
    finally:
        _save_history(readline, history)
