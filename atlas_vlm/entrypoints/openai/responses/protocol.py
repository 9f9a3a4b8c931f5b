"""Request models of ``POST /v1/responses`` (OpenAI's Responses API), pydantic.

Scope: what the ``openai`` SDK's ``client.responses.create`` sends for text and image
conversations: ``input`` (a string, or items: messages with ``input_text`` / ``input_image``
/ ``input_file`` (an image: by ``file_id`` from ``/v1/files``, ``file_data`` or ``file_url``) /
``output_text`` parts, ``function_call`` and ``function_call_output``), ``instructions``,
``max_output_tokens``, ``temperature``, ``top_p`` (and chat completions' ``top_k``, ``min_p``,
penalties and ``logit_bias``), ``stream``, function ``tools`` (the flat
Responses shape) and ``tool_choice``, ``text.format`` (structured output), ``store``,
``background`` and ``previous_response_id``. Unknown fields are refused (400 naming the field), as the chat
models do. Field names and defaults follow OpenAI's API reference for ``responses.create``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag

from atlas_vlm.entrypoints.openai.protocol import LogitBias, MinP, Penalty, RepetitionPenalty, StrictModel, UnicodeBody
from atlas_vlm.entrypoints.openai.schema_rules import FLOAT32_INF, FLOAT32_ZERO, exactly_one


class InputText(StrictModel):
    type: Literal["input_text"]
    text: str


class InputImage(StrictModel):
    """An image by URL or ``data:`` URI (``file_id`` uploads are not supported)."""

    type: Literal["input_image"]
    image_url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] = "auto"


class InputFile(StrictModel):
    """A file part: an image given by ``file_id`` (uploaded to ``/v1/files``), ``file_data``
    (a ``data:`` URL) or ``file_url``; exactly one of the three. Other file kinds (PDF, text)
    are refused when the request is translated (400 naming the part)."""

    model_config = ConfigDict(json_schema_extra=exactly_one("file_id", "file_data", "file_url"))

    type: Literal["input_file"]
    file_id: str | None = None
    file_data: str | None = None
    file_url: str | None = None
    filename: str | None = None


class OutputText(StrictModel):
    """An assistant turn's text in the history (as the server returned it)."""

    type: Literal["output_text"]
    text: str
    annotations: list = []
    logprobs: list | None = None


InputPart = Annotated[InputText | InputImage | InputFile | OutputText, Field(discriminator="type")]


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallItem(StrictModel):
    """A call the model made (an output item fed back as history)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(StrictModel):
    """The result of a call: becomes a ``role: "tool"`` message."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_type(value) -> str:
    return value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")], Discriminator(_item_type)]


class FunctionTool(StrictModel):
    """Responses' flat function tool: ``{"type": "function", "name", "parameters", ...}``."""

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunctionChoice(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    """``text.format``: plain text, any JSON object, or JSON following ``schema``."""

    # type json_schema needs a schema (responses.translate), stated in the schema
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"type": {"const": "json_schema"}}},
        "then": {"required": ["schema"], "properties": {"schema": {"type": "object"}}}})

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(UnicodeBody):
    """``POST /v1/responses`` body (OpenAI defaults: temperature 1, top_p 1, store true)."""

    # stated in the schema: tool_choice other than "none" needs tools (the chat request it
    # becomes); a background response is stored and not streamed (background.py)
    model_config = ConfigDict(json_schema_extra={"allOf": [
        {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {"not": {"enum": [None, "none"]}}}},
         "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}},
        {"if": {"required": ["background"], "properties": {"background": {"const": True}}},
         "then": {"properties": {"store": {"const": True}, "stream": {"const": False}}}}]})

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    # the sampler's float32 bounds, stated (SamplingParams names them in its 400)
    temperature: float | None = Field(default=None, json_schema_extra={"minimum": 0, "exclusiveMaximum": FLOAT32_INF})
    top_p: float | None = Field(default=None, json_schema_extra={"exclusiveMinimum": FLOAT32_ZERO, "maximum": 1})
    # vLLM extras, as on chat completions (ranges checked there; None: off)
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: MinP | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: LogitBias | None = None
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    store: bool = True
    background: bool = False  # run detached: the answer is polled with GET and can be cancelled
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
