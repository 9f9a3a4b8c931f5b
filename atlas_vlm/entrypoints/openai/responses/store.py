"""The server's stored responses (``store: true``, OpenAI's default): a bounded map, oldest
dropped first, for ``GET`` / ``DELETE /v1/responses/{id}``, ``previous_response_id`` and the
polling of ``background`` responses. In memory by default (lost when the server stops;
OpenAI keeps them 30 days); with a directory (``--responses-dir``) each response is also a
file ``DIR/<id>.json`` (written to a temporary name, then renamed: never half-written), and a
server started on that directory finds them again, the newest ``max_stored`` of them."""

from __future__ import annotations

import json
import logging
import os
import re
from collections import OrderedDict
from pathlib import Path

from atlas_vlm.entrypoints.openai.protocol import APIError, printable

logger = logging.getLogger(__name__)
DEFAULT_MAX_STORED = 1024  # responses kept at most; the oldest goes first
_ID = re.compile(r"resp_[0-9a-f]{32}")
UNFINISHED = ("queued", "in_progress")  # a background response's states before its answer


class ResponseStore:
    """Response objects with the chat conversation each one ends (its input messages, without
    ``instructions``, which OpenAI does not carry over, then its answer).

    Args:
        max_stored: responses kept at most (>= 1); storing one more drops the oldest.
        directory: also keep each response as a file there (created if missing), and load
            the newest ``max_stored`` found there (None: memory only).

    Raises:
        ValueError: ``max_stored`` < 1. OSError: ``directory`` cannot be created.
    """

    def __init__(self, max_stored: int = DEFAULT_MAX_STORED, directory: str | os.PathLike | None = None):
        if max_stored < 1:
            raise ValueError(f"max_stored must be >= 1, got {max_stored}")
        self.max_stored = max_stored
        self.directory = None if directory is None else Path(directory)
        self._items: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._load()

    def _load(self) -> None:
        """Read the directory's response files, oldest first (an unreadable one is skipped, logged)."""
        files = sorted((p for p in self.directory.glob("resp_*.json") if _ID.fullmatch(p.stem)),
                       key=lambda p: p.stat().st_mtime)
        for path in files:
            try:
                saved = json.loads(path.read_text())
                self._remember(saved["response"], saved["conversation"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                logger.warning("skipping stored response %s: %s", path.name, e)

    def __len__(self) -> int:
        return len(self._items)

    def _remember(self, response: dict, conversation: list[dict]) -> None:
        self._items[response["id"]] = (response, conversation)
        self._items.move_to_end(response["id"])
        while len(self._items) > self.max_stored:
            old, _ = self._items.popitem(last=False)
            if self.directory is not None:
                (self.directory / f"{old}.json").unlink(missing_ok=True)

    def put(self, response: dict, conversation: list[dict]) -> None:
        """Keep ``response`` (by its ``id``) and its ``conversation`` (chat messages); with a
        directory, also as its file (a write error is logged: the memory copy still serves)."""
        self._remember(response, conversation)
        if self.directory is None:
            return
        path = self.directory / f"{response['id']}.json"
        tmp = path.with_suffix(".json.part")
        try:
            tmp.write_text(json.dumps({"response": response, "conversation": conversation}))
            os.replace(tmp, path)
        except (OSError, TypeError, ValueError) as e:
            logger.warning("could not write stored response %s: %s", path.name, e)
            tmp.unlink(missing_ok=True)

    def _get(self, rid: str, param: str | None) -> tuple[dict, list[dict]]:
        try:
            return self._items[rid]
        except KeyError:
            raise APIError(404, f"Response with id {printable(repr(rid))} not found (not stored, deleted, or "
                           f"dropped as the store holds at most {self.max_stored})", param,
                           "response_not_found") from None

    def response(self, rid: str) -> dict:
        """The stored response object. Raises APIError(404) for an unknown id."""
        return self._get(rid, None)[0]

    def conversation(self, rid: str) -> list[dict]:
        """A copy of the conversation ``rid`` ended, to continue it.

        Raises:
            APIError(param ``previous_response_id``): 404 an unknown id; 400 a background
                response that has no answer yet.
        """
        response, conversation = self._get(rid, "previous_response_id")
        if response.get("status") in UNFINISHED:
            raise APIError(400, f"previous_response_id {rid!r} is still {response['status']}: wait for it to "
                           "finish (GET /v1/responses/{id})", "previous_response_id", "invalid_value")
        return [dict(m) for m in conversation]

    def delete(self, rid: str) -> dict:
        """Forget ``rid``; returns OpenAI's deletion object. Raises APIError(404) for an unknown id."""
        self._get(rid, None)
        del self._items[rid]
        if self.directory is not None:
            (self.directory / f"{rid}.json").unlink(missing_ok=True)
        return {"id": rid, "object": "response.deleted", "deleted": True}
