"""``atlas-vlm chat`` as a user types it, through a pseudo-terminal (stdlib ``pty``): two turns on
the embedded SmolLM2-135M-Instruct (greedy), ``/save``, Ctrl-C mid-answer, ``/clear``, Ctrl-D;
and the commands' errors on a stand-in model (no model load)."""

from __future__ import annotations

import json
import os
import pty
import select
import sys
import time

import pytest

from helpers import IMAGES, REPO
from atlas_vlm.entrypoints.chat_cli import ChatSession

PROMPT = b">>> "


class Terminal:
    """A child process on a pseudo-terminal: ``send`` keys, ``expect`` output (bounded waits)."""

    def __init__(self, argv: list[str], env: dict):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the pty is its controlling terminal (Ctrl-C is SIGINT)
            os.execve(argv[0], argv, env)
        self.buffer = b""

    def expect(self, text: bytes, timeout: float = 300.0) -> bytes:
        """Everything read up to and including ``text``; fails the test after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while text not in self.buffer:
            left = deadline - time.monotonic()
            assert left > 0, f"no {text!r} within {timeout:.0f} s; read so far: {self.buffer[-2000:]!r}"
            if select.select([self.fd], [], [], min(left, 1.0))[0]:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:  # EIO: the child closed the terminal
                    chunk = b""
                assert chunk, f"the chat exited before {text!r}; read: {self.buffer[-2000:]!r}"
                self.buffer += chunk
        head, _, self.buffer = self.buffer.partition(text)
        return head + text

    def send(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def wait(self, timeout: float = 60.0) -> int:
        """The exit code (reading the terminal meanwhile, so the child never blocks on it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
            if select.select([self.fd], [], [], 0.2)[0]:
                try:
                    os.read(self.fd, 4096)
                except OSError:
                    pass
        os.kill(self.pid, 9)
        os.waitpid(self.pid, 0)
        pytest.fail(f"the chat did not exit within {timeout:.0f} s")


@pytest.mark.text
def test_chat_two_turns_save_ctrl_c_clear_and_ctrl_d(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "TERM": "dumb"}
    history = tmp_path / "history"
    argv = [sys.executable, "-m", "atlas_vlm.entrypoints.cli", "chat", "--history-file", str(history),
            "--temperature", "0", "--max-tokens", "200", "--max-model-len", "1024", "--dtype", "float32"]
    term = Terminal(argv, env)
    try:
        term.expect(PROMPT)
        term.send("What is the capital of France?\r")
        first = term.expect(PROMPT)
        assert b"Paris" in first
        term.send("And of Italy?\r")
        term.expect(PROMPT)
        saved = tmp_path / "two.json"
        term.send(f"/save {saved}\r")
        term.expect(b"(conversation saved to")
        term.expect(PROMPT)
        two = json.loads(saved.read_text())
        assert [m["role"] for m in two] == ["user", "assistant", "user", "assistant"]
        assert two[0]["content"] == "What is the capital of France?" and "Paris" in two[1]["content"]
        assert two[1]["content"] in first.decode()  # what streamed is what the history keeps
        assert two[2]["content"] == "And of Italy?" and two[3]["content"]

        term.send("Write a long story about a dragon who learns to cook.\r")
        term.expect(b"cook.")  # the echo of the line
        term.expect(b" ")  # a first piece of the answer
        term.send("\x03")  # Ctrl-C mid-answer: the answer stops, the prompt comes back
        term.expect(b"(answer stopped)")
        term.expect(PROMPT)
        term.send(f"/save {saved}\r")
        term.expect(b"(conversation saved to")
        term.expect(PROMPT)
        three = json.loads(saved.read_text())
        assert len(three) == 6 and three[5]["role"] == "assistant"
        assert three[5]["content"].strip()  # the partial answer is kept

        term.send("/clear\r")
        term.expect(b"(conversation cleared)")
        term.send(f"/save {saved}\r")
        term.expect(b"(conversation saved to")
        term.expect(PROMPT)
        assert json.loads(saved.read_text()) == []
        term.send("\x03")  # one Ctrl-C at the prompt stays
        term.expect(b"(Ctrl-C again, Ctrl-D or /exit to leave)")
        term.expect(PROMPT)
        term.send("\x04")  # Ctrl-D at the prompt leaves
        assert term.wait() == 0
        assert "What is the capital of France?" in history.read_text()  # readline's history file
    finally:
        try:
            os.kill(term.pid, 9)
            os.waitpid(term.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


class _NoModel:
    def chat(self, *args, **kwargs):
        raise AssertionError("the model was asked")


@pytest.mark.text
def test_chat_commands_check_their_arguments_without_the_model(tmp_path, capsys):
    session = ChatSession(_NoModel(), params=None, system="Be brief.")
    for line, message in [("/image", "/image needs a path"), ("/image /nope.png", "/image /nope.png: no such file"),
                          ("/video " + str(IMAGES / "chelsea.png"), "not a video but a still image"),
                          ("/frobnicate", "unknown command '/frobnicate'")]:
        with pytest.raises(ValueError, match=message):
            session.command(line)
    assert session.attached == []
    assert session.command("/image " + str(IMAGES / "chelsea.png"))
    assert session.attached == [{"type": "image", "image": str(IMAGES / "chelsea.png")}]
    assert session.command(f"/save {tmp_path / 'c.json'}") and session.command("/system")
    assert json.loads((tmp_path / "c.json").read_text()) == [{"role": "system", "content": "Be brief."}]
    assert session.conversation() == [] and session.command("/exit") is False
