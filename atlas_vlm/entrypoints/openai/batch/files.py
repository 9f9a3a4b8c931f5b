"""The ``/v1/files`` store: uploaded batch inputs and the batches' output / error files, kept in
one directory (``--files-dir``; default a temporary directory removed when the server stops).

Each file is ``DIR/<id>`` (its bytes) and ``DIR/<id>.json`` (its OpenAI ``file`` object,
written after the bytes are complete, so a file without one is never listed); a store opened
on a directory that holds files already lists them. Ids are ``file-`` and 32 hex digits: any
other id is unknown (404) and never becomes a path.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import time
import uuid
from pathlib import Path

from atlas_vlm.entrypoints.openai.protocol import APIError, printable

logger = logging.getLogger(__name__)

DEFAULT_MAX_FILE_BYTES = 200 * 10**6  # one uploaded file at most (OpenAI's batch input limit: 200 MB)
UPLOAD_PURPOSES = ("batch", "user_data", "vision")  # batch inputs; images for /v1/responses' input_file
CHUNK_BYTES = 1 << 20
_ID = re.compile(r"file-[0-9a-f]{32}")


class FileStore:
    """OpenAI ``file`` objects and their bytes in a directory.

    Args:
        root: the directory (created if missing); None: a new temporary one, removed by ``close``.
        max_file_bytes: largest upload accepted (>= 1).

    Raises:
        ValueError: ``max_file_bytes`` < 1.
        OSError: ``root`` cannot be created or read.
    """

    def __init__(self, root: str | os.PathLike | None = None, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES):
        if max_file_bytes < 1:
            raise ValueError(f"max_file_bytes must be >= 1, got {max_file_bytes}")
        self.max_file_bytes = max_file_bytes
        self._tmp = tempfile.TemporaryDirectory(prefix="atlas-vlm-files-") if root is None else None
        self.root = Path(self._tmp.name if self._tmp else root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, dict] = {}
        for meta in sorted(self.root.glob("file-*.json")):
            try:
                obj = json.loads(meta.read_text())
            except (OSError, ValueError) as e:
                logger.warning("%s: not a file object, skipped (%s)", meta, e)
                continue
            if _ID.fullmatch(meta.stem) and (self.root / meta.stem).is_file():
                self._files[meta.stem] = obj
        self._files = dict(sorted(self._files.items(), key=lambda kv: kv[1].get("created_at", 0)))

    def new_part(self) -> Path:
        """A fresh path in the store's directory to write a file's bytes to (then ``add`` it)."""
        return self.root / f"part-{uuid.uuid4().hex}"

    def add(self, part: Path, filename: str, purpose: str) -> dict:
        """Move the finished bytes at ``part`` into the store; returns the new ``file`` object."""
        file_id = f"file-{uuid.uuid4().hex}"
        os.replace(part, self.root / file_id)
        obj = {"id": file_id, "object": "file", "bytes": (self.root / file_id).stat().st_size,
               "created_at": int(time.time()), "expires_at": None, "filename": filename, "purpose": purpose,
               "status": "processed", "status_details": None}
        tmp = self.root / f"{file_id}.json.part"
        tmp.write_text(json.dumps(obj))
        os.replace(tmp, self.root / f"{file_id}.json")
        self._files[file_id] = obj
        return obj

    async def upload(self, upload, purpose: str) -> dict:
        """Store an uploaded file (``starlette`` ``UploadFile``), copied in 1 MiB chunks.

        Raises:
            APIError: 400 a ``purpose`` other than ``UPLOAD_PURPOSES`` or an empty file; 413
                more than ``max_file_bytes`` (nothing is kept).
        """
        if purpose not in UPLOAD_PURPOSES:
            raise APIError(400, f"purpose {printable(repr(purpose))} is not supported; this server stores files "
                           f"for {', '.join(map(repr, UPLOAD_PURPOSES))}", "purpose", "invalid_value")
        part, size = self.new_part(), 0
        try:
            with open(part, "wb") as f:
                while chunk := await upload.read(CHUNK_BYTES):
                    size += len(chunk)
                    if size > self.max_file_bytes:
                        raise APIError(413, f"file is over the {self.max_file_bytes}-byte limit (--max-file-bytes)",
                                       "file", "file_too_large")
                    f.write(chunk)
            if size == 0:
                raise APIError(400, "file is empty", "file", "invalid_value")
            return self.add(part, upload.filename or "upload.jsonl", purpose)
        finally:
            part.unlink(missing_ok=True)

    def get(self, file_id: str, param: str | None = None) -> dict:
        """The ``file`` object. Raises APIError(404) for an unknown id (naming ``param``)."""
        obj = self._files.get(file_id) if _ID.fullmatch(file_id or "") else None
        if obj is None:
            raise APIError(404, f"No such File object: {printable(repr(file_id))}", param, "file_not_found")
        return obj

    def path(self, file_id: str, param: str | None = None) -> Path:
        """Where the file's bytes are. Raises APIError(404) for an unknown id."""
        self.get(file_id, param)
        return self.root / file_id

    def list(self, purpose: str | None = None, limit: int = 10000, after: str | None = None,
             order: str = "desc") -> dict:
        """OpenAI's list object, newest first (``order="desc"``) or oldest first, at most
        ``limit`` after the file ``after`` (a cursor id), of ``purpose`` only when given."""
        items = [o for o in self._files.values() if purpose is None or o["purpose"] == purpose]
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [o["id"] for o in items]
            items = items[ids.index(after) + 1:] if after in ids else []
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

    def delete(self, file_id: str) -> dict:
        """Remove the file; returns OpenAI's deletion object. Raises APIError(404) if unknown."""
        self.get(file_id)
        del self._files[file_id]
        (self.root / f"{file_id}.json").unlink(missing_ok=True)
        (self.root / file_id).unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}

    def close(self) -> None:
        """Remove the temporary directory (a ``--files-dir`` stays as it is)."""
        if self._tmp is not None:
            self._tmp.cleanup()
