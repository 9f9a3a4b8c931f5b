"""Request models of the OpenAI-compatible API (pydantic), and its error type.

Scope: the fields the ``openai`` client sends to ``/v1/chat/completions`` and
``/v1/completions`` plus vLLM's extras (``top_k``, ``ignore_eos``, ``stop_token_ids``,
``add_generation_prompt``, ``continue_final_message``, ``mm_processor_kwargs``,
``chat_template_kwargs``), structured output (``response_format``, vLLM's
``structured_outputs`` / ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``) and tool calls (``tools``, ``tool_choice``, ``parallel_tool_calls``,
``role: "tool"`` messages). Every model forbids unknown fields, so a feature we do not
implement (``functions``, ``audio``, ...) is refused with HTTP 400 naming the field
instead of being silently ignored. Field names and defaults follow the OpenAI
API reference and vLLM's ``vllm/entrypoints/openai/protocol.py``.
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator
from pydantic_core import PydanticCustomError

from atlas_vlm.entrypoints.openai.schema_rules import FLOAT32_INF, FLOAT32_ZERO, NOT_NULL, at_most_one, non_empty_prompt


# OpenAPI schema of one named server-sent event (``event: NAME`` + ``data: JSON``), as the
# Responses and Anthropic Messages streams send them (chat completions' events are unnamed)
SSE_NAMED_EVENT_SCHEMA = {"type": "object", "required": ["event", "data"],
                          "properties": {"event": {"type": "string"}, "data": {"type": "string"}}}


def printable(text: str) -> str:
    """``text`` with lone surrogates (``"\\ud800"``, which no UTF-8 encoder accepts) written as
    backslash escapes, so that any echo of client input can be encoded."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class APIError(Exception):
    """An error answered as OpenAI's JSON ``{"error": {"message", "type", "param", "code"}}``.

    Args:
        status: HTTP status (400 bad input, 401 key, 404 unknown model or route, 405 method,
            413 body too large, 500 engine fault, 503 busy or unavailable).
        message: what is wrong, naming the input (lone surrogates are escaped in the body).
        param: the request field at fault (dotted path), if any.
        code: a short machine-readable code (``"invalid_image"``, ``"model_not_found"``...).
        headers: extra response headers (``Allow`` on 405, ``Retry-After`` on 503).
    """

    TYPES = {401: "authentication_error", 403: "permission_error", 503: "service_unavailable_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})

    @property
    def type(self) -> str:
        """OpenAI's error type: ``invalid_request_error`` for 4xx, ``server_error`` for 5xx."""
        return self.TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": printable(self.message), "type": self.type,
                          "param": None if self.param is None else printable(self.param), "code": self.code}}


def _find_surrogate(value, path: str) -> str | None:
    """Dotted path of the first string in ``value`` holding a lone surrogate, else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        found = _find_surrogate(k, path) if isinstance(k, str) else None
        found = found or _find_surrogate(v, f"{path}.{k}" if path else str(k))
        if found:
            return found
    return None


def _takes_int(annotation) -> bool:
    """Whether a field's type admits ints but no float (``int``, ``int | None``, ``list[int]``, ...)."""
    args, origin = typing.get_args(annotation), typing.get_origin(annotation)
    if origin is Annotated or origin is list:
        return _takes_int(args[0])
    if args and origin in (typing.Union, types.UnionType):
        kinds = [a for a in args if a is not type(None)]
        return any(_takes_int(a) for a in kinds) and float not in kinds
    return annotation is int


def _as_ints(value):
    """``value`` with its integral floats (in lists too) as ints."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return [_as_ints(v) for v in value] if isinstance(value, list) else value


TOKEN_ID_KEY = r"^(0|[1-9][0-9]{0,18})$"  # a token id as a JSON object key
# the sampling extras' ranges (SamplingParams checks them too), shared by chat, completions, responses
MinP = Annotated[float, Field(ge=0, le=1)]  # vLLM extra; 0: off
Penalty = Annotated[float, Field(ge=-2, le=2)]  # OpenAI's presence / frequency penalty; 0: off
RepetitionPenalty = Annotated[float, Field(gt=0, json_schema_extra={"exclusiveMaximum": FLOAT32_INF})]  # 1: off
LogitBias = Annotated[  # token id (a string, as JSON keys are) -> bias in [-100, 100]
    dict[Annotated[str, Field(pattern=TOKEN_ID_KEY)], Annotated[float, Field(ge=-100, le=100)]],
    WithJsonSchema({"type": "object", "additionalProperties": False,
                    "patternProperties": {TOKEN_ID_KEY: {"type": "number", "minimum": -100, "maximum": 100}}})]


class StrictModel(BaseModel):
    """A request body part as OpenAI checks it; the Anthropic and Responses bodies build on it too."""

    # strict: no coercion, as OpenAI's API ("16" is not an integer, 1 is not a boolean); but an
    # integral float (4.0) is an integer to JSON Schema, so an int field takes it as the int
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _integral_floats(cls, data):
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                key = field.alias or name
                if isinstance(data.get(key), (float, list)) and _takes_int(field.annotation):
                    data = {**data, key: _as_ints(data[key])}
        return data


_Strict = StrictModel  # the short name this file's models use


class ImageURL(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(_Strict):
    url: str


class VideoPart(_Strict):
    """vLLM's ``{"type": "video_url", "video_url": {"url": ...}}`` part (a file, data: URI or URL)."""

    type: Literal["video_url"]
    video_url: VideoURL


ContentPart = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers
    reasoning_content: str | None = None  # an assistant turn's reasoning (templates may drop it)


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None  # JSON schema of the arguments
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    json_schema: dict | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    # type json_schema needs json_schema.schema (entrypoints.openai.structured), stated in the schema
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"type": {"const": "json_schema"}}},
        "then": {"required": ["json_schema"], "properties": {"json_schema": {
            "type": "object", "required": ["schema"], "properties": {"schema": NOT_NULL}}}}})

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# what the structured-output backend accepts, stated in the schema (a choice of no strings, or an
# empty regex / grammar, is refused: structured_output.params)
NonEmptyStr = Annotated[str, Field(min_length=1)]


Choices = Annotated[list[NonEmptyStr], Field(min_length=1)]


class StructuredOutputsField(_Strict):
    """vLLM's ``structured_outputs`` extra (one of these)."""

    json_: dict | str | bool | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: NonEmptyStr | None = None
    choice: Choices | None = None
    grammar: NonEmptyStr | None = None


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the counts so far


class MMProcessorKwargs(_Strict):
    """vLLM's per-request processor options: pixel bounds (images and video frames), and for
    videos the sampling rate ``fps`` (frames per second), a fixed ``num_frames`` and the
    ``total_pixels`` budget of all frames (qwen-vl-utils' options)."""

    max_pixels: int | None = Field(default=None, ge=1)
    min_pixels: int | None = Field(default=None, ge=1)
    fps: float | None = Field(default=None, gt=0, le=240)
    num_frames: int | None = Field(default=None, ge=1, le=4096)
    total_pixels: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _min_within_max(self):
        """A ``min_pixels`` above ``max_pixels`` is lowered to it (the schema cannot state the
        order of two fields, so the server accepts what it allows: ``max_pixels`` wins)."""
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            self.min_pixels = self.max_pixels
        return self


class UnicodeBody(_Strict):
    """A request body whose strings must be valid Unicode: a lone surrogate anywhere is a 400
    naming where it sits (every route's body model derives from this)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        bad = _find_surrogate(data, "") if isinstance(data, dict) else None
        if bad is not None:
            raise PydanticCustomError("lone_surrogate", "{param}: a string holds a lone surrogate (not valid Unicode)",
                                      {"param": bad})
        return data


# the output constraints, at most one per request (entrypoints.openai.structured): field -> its counted values
_COUNTED = {"response_format": {"type": "object", "required": ["type"],
                                "properties": {"type": {"enum": ["json_object", "json_schema"]}}},
            **{name: NOT_NULL for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                                           "guided_grammar")}}
_CONSTRAINTS = at_most_one(_COUNTED)
# tool_choice other than "none" needs tools; a forced one ("required", a named function) no other
# constraint (serving_chat._constraint)
_TOOL_CHOICE_RULES = {"allOf": [
    {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {"not": {"enum": [None, "none"]}}}},
     "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}},
    {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {"anyOf": [{"const": "required"},
                                                                                  {"type": "object"}]}}},
     "then": {"not": {"anyOf": [{"required": [k], "properties": {k: v}} for k, v in _COUNTED.items()]}}}]}


class _SamplingFields(UnicodeBody):
    """Fields shared by chat and completions (OpenAI defaults: temperature 1, top_p 1)."""

    model_config = ConfigDict(json_schema_extra=_CONSTRAINTS)

    model: str | None = None
    # the sampler's float32 bounds, stated in the schema (SamplingParams names them in its 400)
    temperature: float = Field(default=1.0, json_schema_extra={"minimum": 0, "exclusiveMaximum": FLOAT32_INF})
    top_p: float = Field(default=1.0, json_schema_extra={"exclusiveMinimum": FLOAT32_ZERO, "maximum": 1})
    top_k: Annotated[int, Field(ge=-1)] = 0  # vLLM extra; 0 or -1: off
    min_p: MinP | None = None  # vLLM extra; None or 0: off
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extra
    n: int = Field(default=1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM extra
    presence_penalty: Penalty | None = None  # output tokens, once each
    frequency_penalty: Penalty | None = None  # output tokens, per occurrence
    repetition_penalty: RepetitionPenalty | None = None  # vLLM extra; prompt and output tokens
    logit_bias: LogitBias | None = None
    user: str | None = None  # end-user id, recorded by nobody
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None  # vLLM extra
    guided_json: dict | str | None = None  # vLLM extra (older form of structured_outputs)
    guided_regex: NonEmptyStr | None = None  # vLLM extra
    guided_choice: Choices | None = None  # vLLM extra
    guided_grammar: NonEmptyStr | None = None  # vLLM extra


class ChatCompletionRequest(_SamplingFields):
    model_config = ConfigDict(json_schema_extra={**_CONSTRAINTS, **_TOOL_CHOICE_RULES})

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool | None = None  # vLLM extra (default True)
    continue_final_message: bool | None = None  # vLLM extra (default False)
    mm_processor_kwargs: MMProcessorKwargs | None = None  # vLLM extra
    chat_template_kwargs: dict | None = None  # vLLM extra, e.g. {"enable_thinking": false}
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(json_schema_extra=non_empty_prompt)
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = Field(default=False, json_schema_extra={"const": False})  # only False is supported
    best_of: int | None = None  # only None or n is supported
    suffix: str | None = Field(default=None, json_schema_extra={"anyOf": [{"type": "null"}]})  # not supported

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported by this server")
        return v

    @model_validator(mode="after")
    def _best_of_is_n(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of ({self.best_of}) different from n ({self.n}) is not supported by this server")
        return self

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v is not None:
            raise ValueError("suffix is not supported by this server")
        return v


_TYPE_STEPS = {"str", "int", "float", "bool", "none", "list", "dict"}  # union branch names in pydantic locs
# /v1/responses' item and part tags (pydantic puts a tagged union's tag in the loc; not field names)
_TYPE_STEPS |= {"message", "function_call", "function_call_output", "input_text", "input_image", "output_text"}


def validation_error(errors: list[dict]) -> APIError:
    """Turn pydantic's ``errors()`` into one 400 ``APIError`` naming the first bad field;
    an unknown field is reported as an unsupported feature."""
    # in a union (``str | list[...]``) the deepest error is the informative one
    err = max(errors, key=lambda e: len(e.get("loc", ())))
    if err.get("type") == "json_invalid":  # FastAPI puts the byte offset in the loc: it is not a field
        offset = next((p for p in err.get("loc", ()) if isinstance(p, int)), None)
        where = f" at byte {offset}" if offset is not None else ""
        ctx = (err.get("ctx") or {}).get("error", "")
        return APIError(400, f"invalid JSON body{where}" + (f": {ctx}" if ctx else ""), None, "invalid_json")
    if err.get("type") == "lone_surrogate":
        param = (err.get("ctx") or {}).get("param") or None
        return APIError(400, f"invalid request: {err.get('msg')}", param, "invalid_value")
    loc = [str(p) for p in err.get("loc", ()) if p != "body" and str(p) not in _TYPE_STEPS and "[" not in str(p)]
    param = ".".join(loc) or None
    if err.get("type") == "extra_forbidden":
        return APIError(400, f"'{param}' is not supported by this server", param, "unsupported_parameter")
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    return APIError(400, f"invalid request: {param}: {msg}" if param else f"invalid request: {msg}", param,
                    "invalid_value")
