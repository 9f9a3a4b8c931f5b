"""Request models of Anthropic's Messages API (``POST /v1/messages`` and
``/v1/messages/count_tokens``), their translation into our OpenAI chat request, and
Anthropic's error JSON.

Fields and shapes follow Anthropic's API reference (Messages, Count tokens, Errors) and
vLLM's ``vllm/entrypoints/anthropic/protocol.py``. As the OpenAI models, every model here
forbids unknown fields (a feature we do not implement is a 400 naming it), except the
hints clients send on every call and that change no output: ``metadata`` and blocks'
``cache_control`` are accepted and ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from atlas_vlm.entrypoints.openai.protocol import APIError, ChatCompletionRequest, UnicodeBody, StrictModel, printable

# Anthropic's error ``type`` per HTTP status (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               529: "overloaded_error"}


def error_body(e: APIError) -> dict:
    """Anthropic's error JSON for ``e``: ``{"type": "error", "error": {"type", "message"}}``
    (``type`` from the HTTP status: ``ERROR_TYPES``, other 4xx ``invalid_request_error``,
    other 5xx ``api_error``)."""
    kind = ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": printable(e.message)}}


class _Block(StrictModel):
    cache_control: dict | None = None  # prompt-caching hint: accepted, ignored (our prefix cache is automatic)


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    citations: list | None = None  # echoed back by clients in assistant turns; ignored


class Base64Source(StrictModel):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class URLSource(StrictModel):
    type: Literal["url"]
    url: str


class ImageBlock(_Block):
    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


def _blocks_not_of(kind: str) -> dict:
    """JSON schema: the message's content holds no block of type ``kind``."""
    return {"properties": {"content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {
        "not": {"type": "object", "required": ["type"], "properties": {"type": {"const": kind}}}}}]}}}


class Message(StrictModel):
    # tool_use blocks only in assistant turns, tool_result only in user ones (messages_to_chat)
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"role": {"const": "user"}}},
        "then": _blocks_not_of("tool_use"), "else": _blocks_not_of("tool_result")})

    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolDef(StrictModel):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict
    cache_control: dict | None = None  # accepted, ignored
    type: Literal["custom"] | None = None


class ToolChoice(StrictModel):
    # type "tool" needs a name (messages_to_chat), stated in the schema
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"type": {"const": "tool"}}},
        "then": {"required": ["name"], "properties": {"name": {"type": "string", "minLength": 1}}}})

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(UnicodeBody):
    """``POST /v1/messages/count_tokens``: the prompt fields of a Messages request."""

    model: str | None = None
    system: str | list[TextBlock] | None = None
    messages: list[Message] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages`` (Anthropic defaults: temperature 1, top_p and top_k off)."""

    model: str
    max_tokens: int = Field(ge=1)
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # 0: off
    stream: bool = False
    metadata: dict | None = None  # e.g. {"user_id": ...}: accepted, recorded by nobody
    cache_control: dict | None = None  # automatic prompt caching hint: accepted, ignored


def _text(blocks: str | list[TextBlock] | None) -> str:
    return "" if blocks is None else blocks if isinstance(blocks, str) else "\n".join(b.text for b in blocks)


def _image_url(block: ImageBlock) -> str:
    """The image as chat completions takes it: a ``data:`` URI of the base64 bytes, or the URL."""
    src = block.source
    return f"data:{src.media_type};base64,{src.data}" if src.type == "base64" else src.url


def _turns(i: int, m: Message) -> list[dict]:
    """OpenAI chat messages of Anthropic message ``i``: a user turn's ``tool_result`` blocks
    become ``tool`` messages (first, in order), an assistant turn's ``tool_use`` blocks its
    ``tool_calls``; text and images stay the turn's content."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    tools, parts, calls = [], [], []
    for j, b in enumerate(m.content):
        where = f"messages.{i}.content.{j}"
        if b.type == "tool_result":
            if m.role != "user":
                raise APIError(400, f"{where}: tool_result blocks belong in user messages", where)
            text = _text(b.content)
            tools.append({"role": "tool", "tool_call_id": b.tool_use_id,
                          "content": f"Error: {text}" if b.is_error else text})
        elif b.type == "tool_use":
            if m.role != "assistant":
                raise APIError(400, f"{where}: tool_use blocks belong in assistant messages", where)
            calls.append({"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": json.dumps(b.input)}})
        elif b.type == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(b)}})
        else:
            parts.append({"type": "text", "text": b.text})
    out = list(tools)
    if parts or calls or not tools:
        turn: dict = {"role": m.role, "content": (parts or None) if calls else parts}
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    return out


def anthropic_error(e: APIError, req: CountTokensRequest) -> APIError:
    """``e`` (raised on the chat request of ``req``) with a ``messages.I.content.J`` location
    in its param and message rewritten to the Anthropic request's own message and block
    (the chat request has a system message first and ``tool`` messages of its own)."""
    import re

    m = re.match(r"messages\.(\d+)\.content\.(\d+)", e.param or "")
    if m is None:
        return e
    where = {}  # chat (message, part) -> Anthropic (message, block), as ``_turns`` lays them out
    k = 1 if req.system else 0
    for i, msg in enumerate(req.messages):
        if isinstance(msg.content, str):
            k += 1
            continue
        kinds = [b.type for b in msg.content]
        k += kinds.count("tool_result")
        parts = [j for j, t in enumerate(kinds) if t in ("text", "image")]
        where.update({(k, n): (i, j) for n, j in enumerate(parts)})
        k += 1 if parts or "tool_use" in kinds or "tool_result" not in kinds else 0
    found = where.get((int(m.group(1)), int(m.group(2))))
    if found is None:
        return e
    old, new = m.group(0), f"messages.{found[0]}.content.{found[1]}"
    param = new + e.param[len(old):].replace(".image_url", ".source")
    return APIError(e.status, e.message.replace(e.param, param), param, e.code, e.headers)


def to_chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The OpenAI chat request that ``req`` means (the same prompt, sampling and tools), so
    the route runs the chat-completions pipeline. ``tool_choice``: ``auto`` -> "auto",
    ``any`` -> "required", ``tool`` -> that function, ``none`` -> "none".

    Raises:
        APIError(400): a ``tool`` choice without ``name``, a block in the wrong role's turn,
            or any field the chat request refuses (named).
    """
    from pydantic import ValidationError

    from atlas_vlm.entrypoints.openai.protocol import validation_error

    messages = [{"role": "system", "content": _text(req.system)}] if req.system else []
    for i, m in enumerate(req.messages):
        messages.extend(_turns(i, m))
    body: dict = {"model": req.model, "messages": messages}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                           **({"description": t.description} if t.description else {})}}
                         for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise APIError(400, "tool_choice.name is required when tool_choice.type is 'tool'", "tool_choice.name")
        body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                               else {"auto": "auto", "any": "required", "none": "none"}[choice.type])
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                    stream=req.stream, stop=req.stop_sequences)
    try:
        return ChatCompletionRequest.model_validate(body, strict=False)
    except ValidationError as e:
        raise validation_error(list(e.errors())) from e
