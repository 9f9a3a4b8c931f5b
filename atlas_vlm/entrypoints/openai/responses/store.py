"""The server's stored responses (``store: true``, OpenAI's default): a bounded in-memory
map, oldest dropped first, for ``GET`` / ``DELETE /v1/responses/{id}`` and
``previous_response_id``. Lost when the server stops (OpenAI keeps them 30 days)."""

from __future__ import annotations

from collections import OrderedDict

from atlas_vlm.entrypoints.openai.protocol import APIError

DEFAULT_MAX_STORED = 1024  # responses kept at most; the oldest goes first


class ResponseStore:
    """Response objects with the chat conversation each one ends (its input messages, without
    ``instructions``, which OpenAI does not carry over, then its answer).

    Args:
        max_stored: responses kept at most (>= 1); storing one more drops the oldest.
    """

    def __init__(self, max_stored: int = DEFAULT_MAX_STORED):
        if max_stored < 1:
            raise ValueError(f"max_stored must be >= 1, got {max_stored}")
        self.max_stored = max_stored
        self._items: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict, conversation: list[dict]) -> None:
        """Keep ``response`` (by its ``id``) and its ``conversation`` (chat messages)."""
        self._items[response["id"]] = (response, conversation)
        self._items.move_to_end(response["id"])
        while len(self._items) > self.max_stored:
            self._items.popitem(last=False)

    def _get(self, rid: str, param: str | None) -> tuple[dict, list[dict]]:
        try:
            return self._items[rid]
        except KeyError:
            raise APIError(404, f"Response with id '{rid}' not found (not stored, deleted, or dropped as the "
                           f"store holds at most {self.max_stored})", param, "response_not_found") from None

    def response(self, rid: str) -> dict:
        """The stored response object. Raises APIError(404) for an unknown id."""
        return self._get(rid, None)[0]

    def conversation(self, rid: str) -> list[dict]:
        """A copy of the conversation ``rid`` ended, to continue it.

        Raises:
            APIError(404, param ``previous_response_id``): an unknown id.
        """
        return [dict(m) for m in self._get(rid, "previous_response_id")[1]]

    def delete(self, rid: str) -> dict:
        """Forget ``rid``; returns OpenAI's deletion object. Raises APIError(404) for an unknown id."""
        self._get(rid, None)
        del self._items[rid]
        return {"id": rid, "object": "response.deleted", "deleted": True}
