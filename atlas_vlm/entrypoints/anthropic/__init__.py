"""Anthropic's Messages API (``/v1/messages``) on the OpenAI-compatible server."""
