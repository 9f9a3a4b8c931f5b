"""LoRA adapters on the server (vLLM's ``serving_models``: ``--lora-modules``,
``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``, an adapter picked by ``model=NAME``).

Scope: ``LoRAServing`` (the server's adapters by name: load /
unload, ``/v1/models`` cards with ``parent`` = the base model, the ``LoRARequest`` of a
request's ``model``) and ``add_lora_routes``. A request's adapter reaches ``start_choices``
through ``CURRENT_LORA`` (a context variable set by ``ServerContext.check_model`` in the
request's own task). Bad input: an unknown name is a 404 naming it and listing what exists;
an adapter that does not fit is refused at load (400 with the reason) and nothing changes.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading

from pydantic import BaseModel

from atlas_vlm.entrypoints.openai.protocol import APIError
from atlas_vlm.lora import LoRAAdapterError, LoRARequest

#: the LoRARequest of the request being handled (None: the base model); set by check_model
CURRENT_LORA: contextvars.ContextVar[LoRARequest | None] = contextvars.ContextVar("atlas_vlm_lora", default=None)


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's body)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's body; ``lora_int_id`` is accepted and ignored)."""

    lora_name: str
    lora_int_id: int | None = None


class LoRAServing:
    """The server's adapters over an engine with ``enable_lora`` (``engine.runner.lora``).

    Args:
        engine: the ``LLMEngine``; base_name: the served base model name (the cards' ``parent``).
    """

    def __init__(self, engine, base_name: str):
        self.engine, self.base_name, self.manager = engine, base_name, engine.runner.lora
        self.adapters: dict[str, LoRARequest] = {}
        self._next_id, self._lock = 1, threading.Lock()

    @classmethod
    def start(cls, engine, base_name: str, lora_modules=()) -> LoRAServing:
        """The server's adapters with ``lora_modules`` (``[(name, path)]``) loaded.

        Raises:
            ValueError: an adapter refused (the message names it and why).
        """
        serving = cls(engine, base_name)
        for name, path in lora_modules:
            try:
                serving.load(name, path)
            except APIError as e:
                raise ValueError(f"--lora-modules {name}={path}: {e}") from e
        return serving

    def load(self, name: str, path: str) -> LoRARequest:
        """Read and check the adapter (blocking); refused: nothing changes.

        Raises:
            APIError(400): LoRA off, the name is a model or adapter already, or the adapter does not fit.
        """
        if self.manager is None:
            raise APIError(400, "this server serves no LoRA adapters; start it with --enable-lora", "lora_name",
                           "invalid_value")
        if name in self.adapters or name == self.base_name:
            raise APIError(400, f"The lora adapter `{name}` has already been loaded (or names the base model)",
                           "lora_name", "invalid_value")
        with self._lock:
            request, self._next_id = LoRARequest(name, self._next_id, path), self._next_id + 1
        try:
            self.manager.register(request)
        except LoRAAdapterError as e:
            raise APIError(400, str(e), "lora_path", "invalid_value") from e
        self.adapters[name] = request
        return request

    def unload(self, name: str) -> None:
        """Raises: APIError(404) an unknown name (listing the adapters); 400 requests in flight."""
        self.resolve(name)
        try:
            self.manager.remove(name, self.engine.lora_ids_in_flight())
        except LoRAAdapterError as e:
            raise APIError(400, str(e), "lora_name", "invalid_value") from e
        del self.adapters[name]

    def resolve(self, name: str) -> LoRARequest:
        """The adapter called ``name``. Raises: APIError(404) naming it and listing the adapters."""
        if name not in self.adapters:
            raise APIError(404, f"The lora adapter `{name}` does not exist; loaded adapters: {list(self.adapters)}",
                           "lora_name", "model_not_found")
        return self.adapters[name]

    def cards(self, created: int) -> list[dict]:
        """``/v1/models`` cards of the adapters (vLLM's: ``root`` the path, ``parent`` the base)."""
        return [{"id": name, "object": "model", "created": created, "owned_by": "atlas-vlm", "root": r.lora_path,
                 "parent": self.base_name} for name, r in self.adapters.items()]


def add_lora_routes(app, serving: LoRAServing, responses) -> None:
    """``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (plain-text answers, as vLLM)."""
    from fastapi.responses import PlainTextResponse

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=responses(400, 401))
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        await asyncio.to_thread(serving.load, body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=responses(400, 401, 404))
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        serving.unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def parse_lora_modules(items) -> list[tuple[str, str]]:
    """``["NAME=PATH", ...]`` (``--lora-modules``, ``ServerConfig.lora_modules``) -> ``[(NAME, PATH)]``.

    Raises:
        ValueError: an item without ``=``, or a name given twice.
    """
    out: list[tuple[str, str]] = []
    for item in items or ():
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH items, got {item!r}")
        if name in dict(out):
            raise ValueError(f"--lora-modules names {name!r} twice")
        out.append((name, path))
    return out
