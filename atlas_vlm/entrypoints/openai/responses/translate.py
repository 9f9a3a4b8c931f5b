"""A Responses request as the chat-completions request it means (the same prompt, sampling
and constraints: ``/v1/responses`` runs on the chat machinery), and the chat message a
finished answer adds to a stored conversation."""

from __future__ import annotations

import base64
import mimetypes
from collections.abc import Callable

from pydantic import ValidationError

from atlas_vlm.entrypoints.openai.protocol import APIError, ChatCompletionRequest, validation_error
from atlas_vlm.entrypoints.openai.responses.protocol import (FunctionCallItem, FunctionCallOutputItem, InputFile,
                                                             MessageItem, ResponsesRequest)

# file_id -> the file's (bytes, filename); APIError(404) for an unknown id (the /v1/files store)
FileReader = Callable[[str, str], tuple[bytes, str]]

# chat completions' sampling fields a Responses body may carry too (vLLM extras), passed on as they are
SAMPLING_EXTRAS = ("top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
# chat-request fields named in errors, as the Responses request names them
_PARAMS = {"response_format": "text.format", "max_tokens": "max_output_tokens",
           "max_completion_tokens": "max_output_tokens", "messages": "input"}


def responses_param(param: str | None) -> str | None:
    """The Responses field behind a chat-request field named in an error (``response_format``
    -> ``text.format``; ``messages.2...`` -> ``input``: instructions, a previous response's
    turns and merged function calls shift the chat indices, so none is claimed;
    ``response_format.json_schema.schema`` -> ``text.format.schema``; ``tools[i].function.X`` ->
    ``tools[i].X``)."""
    if param is None:
        return None
    head, _, rest = param.partition(".")
    if param.startswith("response_format.json_schema.schema"):  # text.format holds the schema itself
        return "text.format.schema" + param[len("response_format.json_schema.schema"):]
    if head.startswith("tools[") and rest.startswith("function."):  # a Responses tool is flat, same index
        return f"{head}.{rest[len('function.'):]}"
    if head == "messages":
        return "input"
    return _PARAMS.get(head, head) + (f".{rest}" if rest else "")


def _file_url(p: InputFile, param: str, read_file: FileReader | None) -> str:
    """The image URL an ``input_file`` part means: ``file_url`` as it is, ``file_data`` (a
    ``data:`` URL), or the ``/v1/files`` bytes of ``file_id`` as a ``data:`` URL.

    Raises:
        APIError(400): not exactly one source, or not an image (by its data URL's media type,
            or the file name's extension); 404 an unknown ``file_id``.
    """
    given = [name for name in ("file_id", "file_data", "file_url") if getattr(p, name) is not None]
    if len(given) != 1:
        raise APIError(400, f"{param}: an input_file needs exactly one of file_id, file_data, file_url "
                       f"(got {', '.join(given) or 'none'})", param, "invalid_value")
    if p.file_url is not None:
        return p.file_url
    if p.file_data is not None:
        media = p.file_data[5:].split(";", 1)[0] if p.file_data.startswith("data:") else ""
        if not media.startswith("image/"):
            raise APIError(400, f"{param}.file_data: only images are supported as input_file here (a data:image/... "
                           f"URL), got {media or 'no data: URL'}", f"{param}.file_data", "invalid_value")
        return p.file_data
    if read_file is None:
        raise APIError(400, f"{param}.file_id: this server has no file store", f"{param}.file_id", "invalid_value")
    data, filename = read_file(p.file_id, f"{param}.file_id")
    media = mimetypes.guess_type(p.filename or filename)[0] or ""
    if not media.startswith("image/"):
        raise APIError(400, f"{param}.file_id: only image files are supported as input_file here, got "
                       f"{filename!r} ({media or 'unknown type'})", f"{param}.file_id", "invalid_value")
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def _content(item: MessageItem, i: int, read_file: FileReader | None) -> str | list[dict]:
    if isinstance(item.content, str):
        return item.content
    parts = []
    for j, p in enumerate(item.content):
        if p.type == "input_image":
            parts.append({"type": "image_url", "image_url": {"url": p.image_url, "detail": p.detail}})
        elif p.type == "input_file":
            parts.append({"type": "image_url", "image_url": {"url": _file_url(p, f"input.{i}.content.{j}", read_file)}})
        else:
            parts.append({"type": "text", "text": p.text})
    if item.role == "assistant" or all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts if p["type"] == "text")  # templates render text history as a string
    return parts


def input_messages(req: ResponsesRequest, read_file: FileReader | None = None) -> list[dict]:
    """Chat messages of ``req.input`` (without ``instructions``): message items as they are
    (``developer`` as ``system``),
    ``function_call`` items as an assistant turn's ``tool_calls`` (consecutive calls in one
    turn), ``function_call_output`` items as ``role: "tool"`` messages; ``input_file`` images
    as ``image_url`` parts (``file_id`` read through ``read_file``).

    Raises:
        APIError(400, param ``input.N``): an image part in an assistant message.
    """
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    messages: list[dict] = []
    for i, item in enumerate(req.input):
        if isinstance(item, MessageItem):
            if item.role == "assistant" and not isinstance(item.content, str) and any(
                    p.type in ("input_image", "input_file") for p in item.content):
                raise APIError(400, f"input.{i}: an assistant message cannot hold an input_image", f"input.{i}",
                               "invalid_value")
            # the prompt pipeline knows no "developer" role; OpenAI treats it as the system's instructions
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _content(item, i, read_file)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


def chat_request(req: ResponsesRequest, history: list[dict], inputs: list[dict] | None = None
                 ) -> ChatCompletionRequest:
    """The chat request ``req`` means: ``instructions`` as a system message first, then
    ``history`` (a previous response's conversation), then ``req.input`` (``inputs``: its
    messages made already by ``input_messages``); the flat tools as
    chat tools; ``text.format`` as ``response_format``.

    Raises:
        APIError(400): the translated request is invalid (the param named as Responses names it).
    """
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions is not None else [])
    messages += history + (input_messages(req) if inputs is None else inputs)
    if not messages:
        raise APIError(400, "input: no messages to answer", "input", "invalid_value")
    body: dict = {"messages": messages, "stream": req.stream, "parallel_tool_calls": req.parallel_tool_calls}
    if req.model is not None:
        body["model"] = req.model
    for name in ("temperature", "top_p", *SAMPLING_EXTRAS):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                         for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        body["response_format"] = {"type": fmt.type}
        if fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise APIError(400, "text.format: json_schema needs a schema", "text.format.schema", "invalid_value")
            body["response_format"]["json_schema"] = {"name": fmt.name or "response", "schema": fmt.json_schema,
                                                      **({"strict": fmt.strict} if fmt.strict is not None else {})}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        err = validation_error(list(e.errors()))
        raise APIError(400, err.message, responses_param(err.param), err.code) from e


def assistant_message(text: str | None, calls: list[dict]) -> dict:
    """The chat message an answer adds to its conversation (for ``previous_response_id``)."""
    msg: dict = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = [{"id": c["call_id"], "type": "function",
                              "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
    return msg
