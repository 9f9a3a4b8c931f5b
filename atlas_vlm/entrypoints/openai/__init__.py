"""OpenAI-compatible HTTP server over ``AsyncLLM`` (``atlas-vlm serve``)."""
