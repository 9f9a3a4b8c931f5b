"""The engine: ``LLMEngine`` (schedule -> run -> update -> outputs), the ``Scheduler``, and
the input / output processors at its two edges."""

from atlas_vlm.engine.engine import LLMEngine, RequestTooLongError

__all__ = ["LLMEngine", "RequestTooLongError"]
