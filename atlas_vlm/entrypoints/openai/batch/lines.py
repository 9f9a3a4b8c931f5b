"""One line of a batch file, in OpenAI's batch format (platform.openai.com/docs/guides/batch):
the request line ``{"custom_id", "method": "POST", "url", "body"}`` and the result record
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``.

A failed line's record carries the endpoint's error JSON as its ``response.body`` with the
HTTP status the route would have answered, and ``error: {"code", "message"}``. A line that
cannot be told apart by its ``custom_id`` (not JSON, no ``custom_id``, a repeated one) also
carries ``"line"``: its 1-based line number in the input, by which a rerun recognises it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from atlas_vlm.entrypoints.openai.protocol import APIError, printable

ENDPOINT_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


@dataclass
class BatchLine:
    """A parsed request line: its 1-based line number, ``custom_id``, ``url`` and ``body``."""

    line: int
    custom_id: str
    url: str
    body: dict


class LineError(Exception):
    """A request line that cannot be run: ``error`` says why (always a 400); ``custom_id`` is
    the line's id when it has a usable one, else None (the record is then keyed by line)."""

    def __init__(self, error: APIError, custom_id: str | None):
        super().__init__(error.message)
        self.error, self.custom_id = error, custom_id


def parse_line(raw: bytes, line_no: int, endpoint: str | None = None) -> BatchLine:
    """Parse request line ``line_no`` (the raw bytes of one JSONL line).

    Args:
        endpoint: the only ``url`` accepted (a ``/v1/batches`` job's endpoint); None: any of
            ``ENDPOINT_URLS``.

    Raises:
        LineError: not UTF-8 JSON, not an object, ``custom_id`` missing or not a non-empty
            string, ``method`` not ``"POST"``, an unknown ``url`` (or not ``endpoint``),
            ``body`` not an object; the message names the line and the field.
    """
    def bad(msg: str, param: str | None, cid: str | None = None, code: str = "invalid_value") -> LineError:
        return LineError(APIError(400, f"line {line_no}: {msg}", param, code), cid)

    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise bad(f"not UTF-8 text ({e.reason} at byte {e.start})", None, code="invalid_json") from None
    except ValueError as e:
        raise bad(f"not valid JSON ({e})", None, code="invalid_json") from None
    if not isinstance(obj, dict):
        raise bad(f"a request line must be a JSON object, got {type(obj).__name__}", None, code="invalid_json")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise bad("custom_id must be a non-empty string", "custom_id")
    if obj.get("method", "POST") != "POST":
        raise bad(f"method must be \"POST\", got {printable(repr(obj.get('method')))}", "method", cid)
    url = obj.get("url")
    allowed = (endpoint,) if endpoint is not None else ENDPOINT_URLS
    if url not in allowed:
        what = f"this batch's endpoint is {endpoint}" if endpoint is not None else f"supported: {', '.join(allowed)}"
        raise bad(f"url {printable(repr(url))} is not supported ({what})", "url", cid, "invalid_url")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise bad("body must be a JSON object (the endpoint's request)", "body", cid)
    return BatchLine(line_no, cid, url, body)


def validation_errors(source, limit: int = 20) -> tuple[int, list[dict]]:
    """OpenAI's validation of a batch input file: the request lines (non-blank) and the
    errors of the lines that are no request line at all (not JSON, not an object, no
    ``custom_id``, ``method`` not POST, a ``url`` no endpoint has, ``body`` not an object).

    Args:
        source: ``(line_number, raw_bytes)`` pairs (``runner.read_lines``).
        limit: errors kept at most (the first ones).

    Returns:
        ``(request lines, [{"code", "line", "message", "param"}, ...])``, OpenAI's
        ``batch.errors.data`` entries; a line whose ``url`` is another endpoint's, or whose
        ``custom_id`` repeats, is no validation error: it fails alone in the error file.
    """
    total, errors = 0, []
    for line_no, raw in source:
        if not raw.strip():
            continue
        total += 1
        try:
            parse_line(raw, line_no)
        except LineError as e:
            if len(errors) < limit:
                errors.append({"code": e.error.code, "line": line_no, "message": printable(e.error.message),
                               "param": e.error.param})
    return total, errors


def duplicate_error(line_no: int, custom_id: str) -> APIError:
    """The error of a line repeating an earlier line's ``custom_id`` (that one is the one run)."""
    return APIError(400, f"line {line_no}: custom_id {printable(repr(custom_id))} repeats an earlier line's "
                    "(each custom_id must be unique in a batch)", "custom_id", "duplicate_custom_id")


def _ids() -> tuple[str, str]:
    return f"batch_req_{uuid.uuid4().hex}", f"req_{uuid.uuid4().hex}"


def success_record(custom_id: str, body: dict) -> dict:
    """The result record of a line the endpoint answered (status 200, its response body)."""
    rid, request_id = _ids()
    return {"id": rid, "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}


def error_record(custom_id: str | None, error: APIError, line: int | None = None) -> dict:
    """The result record of a failed line: the endpoint's error JSON and status; ``line``
    given for a line keyed by its number (no usable or a repeated ``custom_id``)."""
    rid, request_id = _ids()
    record = {"id": rid, "custom_id": custom_id,
              "response": {"status_code": error.status, "request_id": request_id, "body": error.body()},
              "error": {"code": error.code, "message": error.body()["error"]["message"]}}
    if line is not None:
        record["line"] = line
    return record


def record_ok(record: dict) -> bool:
    """Whether a result record is a success (status 200, no error)."""
    response = record.get("response") or {}
    return record.get("error") is None and response.get("status_code") == 200
