"""``RemoteEngine``: the ``AsyncLLM`` interface the OpenAI routes use, over N engine replicas
reached through Ray Serve deployment handles (ingress side of ``atlas-vlm serve --replicas``).

The routes (``serving_chat`` / ``serving_completion``) call ``add_request`` and iterate the
returned stream exactly as on one ``AsyncLLM``; here each request is routed by
``ReplicaRouter`` to one replica's streaming ``generate`` method. A replica that fails (its
actor died, or it is unreachable) is marked down in the router: a request not yet started
on it is retried once on another live replica; a request in flight on it ends with
``EngineDeadError`` (HTTP 503 ``engine_unavailable``); a background probe marks it up again
once Ray Serve has restarted it. ``/metrics`` is every replica's own Prometheus text with a
``replica`` label, plus the router's counters.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from atlas_vlm.engine.request_stream import EngineDeadError
from atlas_vlm.entrypoints.replica_router import ReplicaRouter, routing_keys

logger = logging.getLogger(__name__)


def _is_replica_failure(e: BaseException) -> bool:
    import ray.exceptions

    return isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                          ray.exceptions.RaySystemError)) or type(e).__name__ in {"ActorDiedError",
                                                                                   "DeploymentUnavailableError"}


class RemoteStream:
    """What ``RemoteEngine.add_request`` returns: an async iterator of ``RequestOutput`` with
    ``num_cached_tokens`` (the replica's prefix-cache hits) and ``aclose`` (aborts on the replica)."""

    def __init__(self, engine: RemoteEngine, replica: int, request_id: str, gen):
        self.engine, self.replica, self.request_id, self._gen = engine, replica, request_id, gen
        self._cached = 0  # the replica's prefix-cache hits, as its last output reported them
        self._done = False
        self._iterator = self._iterate()

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens the replica found in its prefix cache (``RequestStream``'s field)."""
        return self._cached

    def __aiter__(self):
        return self._iterator

    async def _iterate(self) -> AsyncIterator:
        try:
            async for _kind, out, cached in self._gen:
                self._cached = cached
                yield out
                if out.finished:
                    return
        except Exception as e:
            if not _is_replica_failure(e):
                raise
            self.engine.replica_failed(self.replica, e)
            raise EngineDeadError(f"replica {self.replica} failed while serving request {self.request_id}: "
                                  f"{type(e).__name__}; retry the request") from e
        finally:
            self._close()

    def _close(self) -> None:
        if not self._done:
            self._done = True
            self._gen.cancel()  # Ray Serve cancels the replica's generator: its finally aborts the request
            self.engine.router.finished(self.replica)

    async def aclose(self) -> None:
        await self._iterator.aclose()
        self._close()


class RemoteEngine:
    """Routes engine requests to replica handles (each a deployment of ``EngineReplica``).

    Args:
        handles: one ``DeploymentHandle`` per replica, in replica order.
        router: the ``ReplicaRouter`` (its ``num_replicas == len(handles)``).
        tokenizer_path: model folder or .gguf, for the routes' logprob strings (loaded lazily).
        probe_interval_s: how often a failed replica is probed until it answers again.
    """

    def __init__(self, handles: list, router: ReplicaRouter, tokenizer_path: str, probe_interval_s: float = 1.0):
        if len(handles) != router.num_replicas:
            raise ValueError(f"{len(handles)} handles for a router of {router.num_replicas} replicas")
        self.handles, self.router, self.tokenizer_path = handles, router, tokenizer_path
        self.probe_interval_s = probe_interval_s
        self._tokenizer = None
        self._probes: dict[int, asyncio.Task] = {}

    @property
    def alive(self) -> bool:
        """True while at least one replica is routed to (``/health``)."""
        return any(self.router.alive)

    @property
    def tokenizer(self):
        """The model's tokenizer (for logprob token strings only; routing needs none)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            from atlas_vlm.hub import resolve_model_path
            path = resolve_model_path(self.tokenizer_path)
            if path.is_file():  # a .gguf: its header's tokenizer, in memory (no dense copy for a tokenizer)
                from atlas_vlm.checkpoint import read_gguf
                from atlas_vlm.quantization.gguf_meta import gguf_config, gguf_tokenizer
                from atlas_vlm.tokenizer import gguf_tokenizer_settings

                reader = read_gguf(path)
                self._tokenizer = gguf_tokenizer(reader, gguf_config(reader, path),
                                                 gguf_tokenizer_settings(path, reader.fields))
            else:
                self._tokenizer = AutoTokenizer.from_pretrained(path)
        return self._tokenizer

    async def add_request(self, prompt, sampling_params, request_id: str, arrival_time: float | None = None):
        """Route and start one request; returns a ``RemoteStream``.

        Raises:
            EngineDeadError: no replica could take it (after one retry on another replica).
            QueueFullError, RequestTooLongError, ImageInputError, ValueError: the replica's
                ``AsyncLLM.add_request`` error, unchanged.
        """
        hashes, images = routing_keys(prompt)
        tried: set[int] = set()
        while True:
            i = self.router.choose(hashes, images)
            if i in tried:
                i = next((j for j in range(self.router.num_replicas) if j not in tried and self.router.alive[j]), i)
            tried.add(i)
            self.router.started(i)
            gen = self.handles[i].options(stream=True).generate.remote(prompt, sampling_params, request_id)
            try:
                kind, payload, _ = await gen.__anext__()
            except Exception as e:
                self.router.finished(i)
                gen.cancel()
                if not _is_replica_failure(e):
                    raise
                self.replica_failed(i, e)
                if len(tried) < 2 and self.router.num_replicas > 1:
                    continue
                raise EngineDeadError(f"replica {i} is unavailable ({type(e).__name__}); retry the request") from e
            except BaseException:
                self.router.finished(i)
                gen.cancel()
                raise
            if kind == "error":
                self.router.finished(i)
                raise payload
            return RemoteStream(self, i, request_id, gen)

    def abort(self, request_id: str) -> None:  # streams abort themselves on close
        pass

    def replica_failed(self, i: int, error: BaseException) -> None:
        """Mark replica ``i`` down and probe it until Ray Serve has it back."""
        if self.router.alive[i]:
            logger.warning("replica %d failed (%s: %s); routing around it", i, type(error).__name__, error)
        self.router.mark(i, False)
        if i not in self._probes or self._probes[i].done():
            self._probes[i] = asyncio.get_running_loop().create_task(self._probe(i))

    async def _probe(self, i: int) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            try:
                await self.handles[i].ping.remote()
            except Exception:  # noqa: BLE001 - still restarting; probe again
                continue
            self.router.mark(i, True)
            logger.info("replica %d is back", i)
            return

    async def metrics_text(self) -> bytes:
        """Prometheus text: each replica's metrics with ``replica="i"``, and the router's."""
        async def one(h):
            return await h.metrics_text.remote()
        texts = await asyncio.gather(*(asyncio.wait_for(one(h), 10) for h in self.handles), return_exceptions=True)
        families: dict[str, Metric] = {}
        for i, text in enumerate(texts):
            if isinstance(text, BaseException):
                continue
            for fam in text_string_to_metric_families(text):
                merged = families.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type))
                merged.samples += [s._replace(labels={**s.labels, "replica": str(i)}) for s in fam.samples]
        rows = [("atlas:replica_up", "gauge", "1 if the replica answered this scrape and is routed to.",
                 lambda i: float(not isinstance(texts[i], BaseException) and self.router.alive[i])),
                ("atlas:router_requests_in_flight", "gauge", "Requests in flight per replica (router's count).",
                 lambda i: float(self.router.in_flight[i]))]
        for name, kind, doc, value in rows:
            m = families.setdefault(name, Metric(name, doc, kind))
            for i in range(self.router.num_replicas):
                m.add_sample(name, {"replica": str(i)}, value(i))
        m = families.setdefault("atlas:router_decisions", Metric("atlas:router_decisions",
                                                                 "Routing decisions by reason.", "counter"))
        for reason, n in self.router.decisions.items():
            m.add_sample("atlas:router_decisions_total", {"reason": reason, "policy": self.router.policy}, float(n))

        class _Collector:
            def collect(self):
                return list(families.values())
        registry = CollectorRegistry()
        registry.register(_Collector())
        return generate_latest(registry)
