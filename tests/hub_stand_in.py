"""A stand-in Hugging Face Hub on 127.0.0.1 (``http.server`` in a thread, a free port) and tiny
GGUF files to serve: what ``huggingface_hub`` asks of the Hub when ``HF_ENDPOINT`` points here.

Endpoints (those ``list_repo_files``, ``snapshot_download`` and ``hf_hub_download`` call):
``GET /api/models/{repo}/revision/{rev}`` (``repo_info``: ``sha`` + ``siblings``),
``GET /api/models/{repo}/tree/{rev}`` (the recursive listing: ``type`` / ``path`` / ``size`` /
``oid``), ``HEAD`` / ``GET /{repo}/resolve/{rev}/{file}`` (the file, with ``ETag``,
``X-Repo-Commit`` and ``Content-Length``). An unknown repo answers 404 with
``X-Error-Code: RepoNotFound``, an unknown file 404 with ``EntryNotFound``, as the Hub does.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import numpy as np

COMMIT = "a1b2c3d4e5f60718293a4b5c6d7e8f9012345678"
HIDDEN, INTER, HEADS, KV_HEADS, LAYERS, VOCAB = 64, 128, 2, 1, 2, 49152


class StandInHub:
    """``repos``: ``{"org/name": {path in repo: bytes}}``; ``requests``: ``(method, path)`` seen."""

    def __init__(self, repos: dict[str, dict[str, bytes]]):
        self.repos, self.requests = repos, []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                hub._answer(self, body=False)

            def do_GET(self):
                hub._answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)

    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(h.path).path)
        self.requests.append((h.command, path))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
            repo, kind = "/".join(parts[2:4]), parts[4]
            if repo not in self.repos:
                return self._send(h, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, body)
            files = self.repos[repo]
            if kind == "revision":
                info = {"id": repo, "sha": COMMIT, "siblings": [{"rfilename": f} for f in sorted(files)]}
            else:
                info = [{"type": "file", "path": f, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                        for f, d in sorted(files.items())]
            return self._send(h, 200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, name = "/".join(parts[:2]), "/".join(parts[4:])
            if repo not in self.repos:
                return self._send(h, 404, b"", {"X-Error-Code": "RepoNotFound"}, body)
            if name not in self.repos[repo]:
                return self._send(h, 404, b"", {"X-Error-Code": "EntryNotFound"}, body)
            data = self.repos[repo][name]
            headers = {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Repo-Commit": COMMIT,
                       "Content-Type": "application/octet-stream"}
            return self._send(h, 200, data, headers, body)
        self._send(h, 404, b"", {}, body)

    @staticmethod
    def _send(h, status: int, data: bytes, headers: dict, body: bool) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)


def write_tiny_gguf(path: Path, seed: int = 0, split_max_tensors: int = 0) -> list[Path]:
    """A random llama-architecture GGUF (SmolLM2's tokenizer, vocab 49152, hidden 64, 2 layers,
    Q8_0 projections and embedding, F32 norms), as one file or, with ``split_max_tensors``,
    split by ``GGUFWriter`` into ``stem-0000i-of-0000n.gguf`` parts. The same ``seed`` gives
    the same tensors either way. Returns the files written."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import quantize

    from atlas_vlm.default_models import default_text_model

    src = GGUFReader(str(default_text_model()))
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "llama", split_max_tensors=split_max_tensors)
    for key, field in src.fields.items():
        if key.startswith("tokenizer.") or key in ("llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon"):
            sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    w.add_context_length(512), w.add_embedding_length(HIDDEN), w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTER), w.add_head_count(HEADS), w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS), w.add_vocab_size(VOCAB)

    def q8(rows: int, cols: int, amp: float) -> np.ndarray:
        return quantize(rng.uniform(-amp, amp, (rows, cols)).astype(np.float32), GGMLQuantizationType.Q8_0)

    w.add_tensor("token_embd.weight", q8(VOCAB, HIDDEN, 1.0), raw_dtype=GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    hd = HIDDEN // HEADS
    shapes = dict(attn_q=(HEADS * hd, HIDDEN), attn_k=(KV_HEADS * hd, HIDDEN), attn_v=(KV_HEADS * hd, HIDDEN),
                  attn_output=(HIDDEN, HIDDEN), ffn_gate=(INTER, HIDDEN), ffn_up=(INTER, HIDDEN), ffn_down=(HIDDEN, INTER))
    for i in range(LAYERS):
        for part in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{part}.weight", rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32))
        for part, (n, k) in shapes.items():
            w.add_tensor(f"blk.{i}.{part}.weight", q8(n, k, 0.2), raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
    if not split_max_tensors:
        return [path]
    return sorted(path.parent.glob(f"{path.stem}-*-of-*.gguf"))
