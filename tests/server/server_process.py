"""The real ``python -m atlas_vlm.serve`` as a subprocess on a free 127.0.0.1 port (health
polled with a bounded timeout, SIGTERM to stop), ``/metrics`` parsing, and the settings the
server fixtures and their in-process ``LLM`` references share."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from helpers import REPO

START_TIMEOUT_S = 240  # import torch + load the model on a busy 2-core machine
# the in-process references use the same settings; fp32, the exactness reference on any CPU
TEXT_ARGS = ["--max-model-len", "512", "--kv-cache-memory", "64MiB", "--dtype", "float32"]
TEXT_LLM_KWARGS = dict(max_model_len=512, kv_cache_memory=64 << 20, dtype="float32")
VLM_ARGS = ["--max-model-len", "1024", "--kv-cache-memory", "32MiB", "--max-pixels", str(64 * 28 * 28),
            "--dtype", "float32"]
VLM_LLM_KWARGS = dict(max_model_len=1024, kv_cache_memory=32 << 20, max_pixels=64 * 28 * 28, dtype="float32")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    """No socket listens on 127.0.0.1:``port``: a new server could bind it. With SO_REUSEADDR,
    as uvicorn binds: connections the old server closed and left in TIME_WAIT do not hold
    the port (without it, whether the server or the client closed last decided the answer),
    a listening socket still does."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


class ServerProcess:
    """``python -m atlas_vlm.serve MODEL ARGS --port P`` run from the repo root."""

    def __init__(self, model: str | None, *args: str, name: str = "test-model", launcher: list[str] | None = None,
                 env: dict[str, str] | None = None):
        """``name``: ``--served-model-name`` (None: not passed; a several-model server);
        ``launcher``: the command before the serve arguments (default ``python -m
        atlas_vlm.serve``; the fault tests use ``python tests/server/fault_server.py``);
        ``env``: extra environment variables."""
        import os

        self.port = free_port()
        self.name = name
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [*(launcher or [sys.executable, "-m", "atlas_vlm.serve"]), *([model] if model else []),
               "--port", str(self.port), *(["--served-model-name", name] if name else []), "--log-level", "warning",
               *args]
        self.log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a full pipe would block the server
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})})
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.output()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"server not healthy within {START_TIMEOUT_S} s")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=kwargs.pop("api_key", "none"), max_retries=0,
                             timeout=kwargs.pop("timeout", 300), **kwargs)

    def metrics(self) -> dict[str, float]:
        """Every sample of ``/metrics`` as ``{name{labels}: value}`` (labels sorted)."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.log.close()
        return self.proc.returncode
