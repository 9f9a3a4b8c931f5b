"""How users reach the engine: the ``LLM`` facade (and, as they arrive, the CLI and servers)."""
