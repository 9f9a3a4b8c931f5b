"""``ModelRouter``: several models behind one server, loaded on demand (issue 36, item 1;
Ollama's scheduler and llama-server's router mode behave the same way).

The router owns one ``LoadedModel`` (its ``ServerContext``, a ``close`` that shuts its
``AsyncLLM`` down, its Prometheus registry) per resident model, by served name. A route
``acquire``s the context of its request's ``model`` and ``release``s it when the answer (or
stream) ends (``router_routes.RoutedContext.lease``: both). The first request for an unloaded model starts its load (in a
thread, so other models keep serving); concurrent requests wait on that same load, each at
most ``load_timeout_s`` (then 503 with ``Retry-After``). At most ``max_loaded`` models are
resident: before a load, the least recently used model with no request in flight or waiting
for it is unloaded (else the load waits; a waiting request keeps two loads from evicting each
other's model). ``idle_unload_s`` unloads a model idle that long. A load that fails fails its
waiting requests (500 naming the model and the cause) and is tried again on the next
request. Loads and unloads run one at a time. Unloading returns memory: the engine is shut
down, every reference dropped, ``gc.collect()`` run and glibc's ``malloc_trim(0)`` called.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from atlas_vlm.entrypoints.openai.model_specs import ModelSpec
from atlas_vlm.entrypoints.openai.protocol import APIError

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A resident model: the routes' ``ctx`` (``ServerContext``), ``close()`` (shut the
    engine down and wait for its thread) and its metrics ``registry``."""

    ctx: object
    close: Callable[[], None]
    registry: object = None


@dataclass
class _Slot:
    spec: ModelSpec
    loaded: LoadedModel | None = None
    loading: asyncio.Task | None = None
    in_flight: int = 0
    waiting: int = 0  # requests waiting for its load: it is not evicted under them

    @property
    def busy(self) -> bool:
        return bool(self.in_flight or self.waiting)
    last_used: float = field(default_factory=time.monotonic)


def release_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc ``malloc_trim(0)``;
    a no-op on other C libraries)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class ModelRouter:
    """Engines by served name (see the module docstring).

    Args:
        specs: the models served, in listing order (names unique).
        build: ``spec -> LoadedModel``, run in a worker thread (blocking; raises on failure).
        max_loaded: models resident at most (>= 1).
        load_timeout_s: seconds a request waits for its model to load (then 503).
        idle_unload_s: unload a model idle this many seconds (None: never).
    """

    def __init__(self, specs: list[ModelSpec], build: Callable[[ModelSpec], LoadedModel], *, max_loaded: int = 1,
                 load_timeout_s: float = 600.0, idle_unload_s: float | None = None):
        if max_loaded < 1:
            raise ValueError(f"--max-loaded-models must be >= 1, got {max_loaded}")
        if load_timeout_s <= 0:
            raise ValueError(f"--model-load-timeout-s must be > 0, got {load_timeout_s}")
        self.slots = {s.name: _Slot(s) for s in specs}
        self.build, self.max_loaded = build, max_loaded
        self.load_timeout_s, self.idle_unload_s = load_timeout_s, idle_unload_s
        self._lock: asyncio.Lock | None = None  # loads and unloads one at a time (made on the loop)
        self._released: asyncio.Event | None = None

    @property
    def names(self) -> list[str]:
        return list(self.slots)

    def status(self, name: str) -> str:
        """``loaded``, ``loading`` or ``unloaded``."""
        slot = self.slots[name]
        return "loaded" if slot.loaded else "loading" if slot.loading else "unloaded"

    def loaded(self) -> dict[str, LoadedModel]:
        """The resident models by name."""
        return {n: s.loaded for n, s in self.slots.items() if s.loaded is not None}

    def slot(self, name: str | None) -> _Slot:
        """The slot of a request's ``model``.

        Raises:
            APIError(400): no ``model`` given; APIError(404): a name not served (the message
            lists the served ones).
        """
        if name is None:
            raise APIError(400, f"`model` is required: this server serves several models {self.names}",
                           "model", "missing_model")
        if name not in self.slots:
            raise APIError(404, f"The model `{name}` does not exist; this server serves {self.names}",
                           "model", "model_not_found")
        return self.slots[name]

    def _sync(self) -> None:
        if self._lock is None:
            self._lock, self._released = asyncio.Lock(), asyncio.Event()

    async def acquire(self, name: str | None):
        """The ``ServerContext`` of model ``name``, loading it first if needed; the caller
        must ``release(name)`` when its request ends.

        Raises:
            APIError: 400 / 404 (``slot``), 503 (still loading after ``load_timeout_s``,
            ``Retry-After``), 500 (the load failed: the model and the cause named).
        """
        self._sync()
        slot = self.slot(name)
        deadline = time.monotonic() + self.load_timeout_s
        slot.waiting += 1  # from here until in flight, another model's load does not evict this one
        try:
            while slot.loaded is None:
                if slot.loading is None:
                    slot.loading = asyncio.create_task(self._load(slot))
                try:
                    await asyncio.wait_for(asyncio.shield(slot.loading), max(0.0, deadline - time.monotonic()))
                except (asyncio.TimeoutError, TimeoutError):
                    raise APIError(503, f"model `{name}` is still loading after {self.load_timeout_s:g} s; "
                                   "retry later", "model", "model_loading",
                                   headers={"Retry-After": str(max(1, int(self.load_timeout_s)))}) from None
        finally:
            slot.waiting -= 1
            self._released.set()
        slot.in_flight += 1
        slot.last_used = time.monotonic()
        return slot.loaded.ctx

    def release(self, name: str) -> None:
        """End one request of ``name`` (its model may now be unloaded)."""
        slot = self.slots[name]
        slot.in_flight = max(0, slot.in_flight - 1)
        slot.last_used = time.monotonic()
        if self._released is not None:
            self._released.set()

    async def _load(self, slot: _Slot) -> None:
        try:
            async with self._lock:
                if slot.loaded is not None:
                    return
                await self._make_room()
                logger.info("loading model %s (%s)", slot.spec.name, slot.spec.model)
                try:
                    slot.loaded = await asyncio.to_thread(self.build, slot.spec)
                except Exception as e:  # noqa: BLE001 - every load failure is answered, the server keeps serving
                    logger.error("model %s failed to load: %s", slot.spec.name, e)
                    release_memory()
                    raise APIError(500, f"model `{slot.spec.name}` failed to load: {type(e).__name__}: {e}",
                                   "model", "model_load_failed") from e
                slot.last_used = time.monotonic()
        finally:
            slot.loading = None

    async def _make_room(self) -> None:
        """Unload least recently used idle models until a load fits ``max_loaded`` (holding
        the lock); waits for a request to end while every resident model is busy."""
        while len(self.loaded()) >= self.max_loaded:
            idle = [s for s in self.slots.values() if s.loaded is not None and not s.busy]
            if idle:
                await self._unload(min(idle, key=lambda s: s.last_used))
                continue
            self._released.clear()
            await self._released.wait()

    async def _unload(self, slot: _Slot) -> None:
        loaded, slot.loaded = slot.loaded, None
        logger.info("unloading model %s", slot.spec.name)
        await asyncio.to_thread(loaded.close)
        del loaded
        await asyncio.to_thread(release_memory)

    async def load(self, name: str | None) -> None:
        """Load ``name`` now (``POST /models/load``); errors as ``acquire``."""
        await self.acquire(name)
        self.release(name)

    async def unload(self, name: str | None) -> bool:
        """Unload ``name`` now (``POST /models/unload``), after a load in progress; False if it
        was not loaded.

        Raises:
            APIError: 400 / 404 (``slot``); 409 while it has requests in flight.
        """
        self._sync()
        slot = self.slot(name)
        async with self._lock:
            if slot.loaded is None:
                return False
            if slot.in_flight:
                raise APIError(409, f"model `{name}` has {slot.in_flight} request(s) in flight; not unloaded",
                               "model", "model_busy")
            await self._unload(slot)
            return True

    async def unload_idle(self) -> None:
        """Unload every model idle ``idle_unload_s`` or longer (no request in flight)."""
        self._sync()
        now = time.monotonic()
        for slot in self.slots.values():
            if (slot.loaded is not None and not slot.busy and self.idle_unload_s is not None
                    and now - slot.last_used >= self.idle_unload_s):
                async with self._lock:
                    if slot.loaded is not None and not slot.busy:
                        await self._unload(slot)

    async def run_idle_unloader(self) -> None:
        """Forever: ``unload_idle`` every ``min(idle_unload_s / 4, 1)`` seconds (a task the
        app starts; returns at once without ``idle_unload_s``)."""
        if self.idle_unload_s is None:
            return
        while True:
            await asyncio.sleep(min(self.idle_unload_s / 4, 1.0))
            await self.unload_idle()

    async def close(self) -> None:
        """Unload every model (server shutdown)."""
        self._sync()
        async with self._lock:
            for slot in self.slots.values():
                if slot.loaded is not None:
                    await self._unload(slot)
