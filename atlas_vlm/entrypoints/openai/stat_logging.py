"""Logs a person reads, besides the access log (``access_log``): the server's startup lines
and, every ``--log-stats-interval`` seconds while the engine is busy, one engine line as vLLM
prints it (``vllm/v1/metrics/loggers.py``'s ``LoggingStatLogger``), on ``atlas_vlm.stats``:

    Engine: Avg prompt throughput: 412.0 tokens/s, Avg generation throughput: 38.5 tokens/s,
        Running: 2 reqs, Waiting: 0 reqs, KV cache usage: 3.1%, Prefix cache hit rate: 41.7%

(one line). Throughputs are the tokens prefilled / generated since the last line over the
seconds since it; running / waiting and KV usage (blocks in use over all blocks) are the
engine's snapshot after its last step; the prefix-cache hit rate is prompt tokens served by
the cache over prompt tokens looked up, since start. "Busy": a token was prefilled or
generated since the last line, or a request runs or waits; one more line follows the last
busy one (so the log shows the engine went idle).
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger("atlas_vlm.stats")
startup_logger = logging.getLogger("atlas_vlm.serve")


class StatLoggers:
    """Several ``AsyncLLM`` stat loggers as one (its ``stat_logger`` argument takes one):
    each callback goes to every logger, in order."""

    def __init__(self, *loggers):
        self.loggers = [lg for lg in loggers if lg is not None]

    def on_step(self, stats, batch_size: int) -> None:
        for lg in self.loggers:
            lg.on_step(stats, batch_size)

    def on_first_token(self, seconds: float, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        for lg in self.loggers:
            lg.on_first_token(seconds, num_prompt_tokens, num_cached_tokens)

    def on_new_tokens(self, n: int, seconds_per_token: float | None) -> None:
        for lg in self.loggers:
            lg.on_new_tokens(n, seconds_per_token)

    def on_finish(self, output) -> None:
        for lg in self.loggers:
            lg.on_finish(output)


class LoggingStatLogger:
    """The periodic engine line (see the module docstring). Fed by ``AsyncLLM`` from the
    engine thread; :meth:`start` runs a daemon thread that logs every ``interval_s`` seconds.

    Raises:
        ValueError: ``interval_s`` not > 0.
    """

    def __init__(self, interval_s: float = 10.0):
        if not interval_s > 0:
            raise ValueError(f"--log-stats-interval must be > 0 seconds, got {interval_s}")
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._prompt = self._generation = 0  # tokens since the last line
        self._queries = self._hits = 0  # prompt tokens looked up / served by the prefix cache, since start
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._was_busy = False

    # ---- AsyncLLM callbacks (engine thread) ---------------------------------------------------
    def on_step(self, stats, batch_size: int) -> None:
        pass

    def on_first_token(self, seconds: float, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        with self._lock:
            self._prompt += num_prompt_tokens
            self._queries += num_prompt_tokens
            self._hits += num_cached_tokens

    def on_new_tokens(self, n: int, seconds_per_token: float | None) -> None:
        with self._lock:
            self._generation += n

    def on_finish(self, output) -> None:
        pass

    # ---- the line --------------------------------------------------------------------------
    def line(self, stats, elapsed_s: float) -> str | None:
        """The engine line for the ``elapsed_s`` seconds since the last one, ``stats`` the
        engine snapshot (``EngineStats``), or None when the engine stayed idle; resets the
        token counts since the last line."""
        with self._lock:
            prompt, generation, self._prompt, self._generation = self._prompt, self._generation, 0, 0
            hit_rate = 100.0 * self._hits / self._queries if self._queries else 0.0
        busy = bool(prompt or generation or stats.num_running or stats.num_waiting)
        if not (busy or self._was_busy):
            return None
        self._was_busy = busy
        used = stats.num_blocks - stats.num_free_blocks
        usage = 100.0 * used / stats.num_blocks if stats.num_blocks else 0.0
        elapsed_s = max(elapsed_s, 1e-9)
        return (f"Engine: Avg prompt throughput: {prompt / elapsed_s:.1f} tokens/s, Avg generation throughput: "
                f"{generation / elapsed_s:.1f} tokens/s, Running: {stats.num_running} reqs, Waiting: "
                f"{stats.num_waiting} reqs, KV cache usage: {usage:.1f}%, Prefix cache hit rate: {hit_rate:.1f}%")

    def start(self, front) -> None:
        """Log the line of ``front`` (an ``AsyncLLM``: its ``stats`` snapshot) every
        ``interval_s`` seconds until :meth:`stop`."""
        def run():
            last = time.monotonic()
            while not self._stop.wait(self.interval_s):
                now = time.monotonic()
                text = self.line(front.stats, now - last)
                last = now
                if text is not None:
                    logger.info("%s", text)

        self._thread = threading.Thread(target=run, name="atlas-log-stats", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def log_startup(host: str, port: int, model: str, served_names: list[str], random_weights: bool) -> None:
    """The startup lines: what is served under which names, the chat page's URL, and a
    warning when the model has random weights (its words are not meaningful)."""
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    startup_logger.info("serving %s as %s on %s (OpenAI API at %s/v1, API docs at %s/docs)", model, served_names,
                        url, url, url)
    startup_logger.info("chat page: %s/", url)
    if random_weights:
        startup_logger.warning("the model %s has RANDOM weights (a test / demo checkpoint): its answers are not "
                               "meaningful; serve a trained checkpoint for real answers", served_names[0])
