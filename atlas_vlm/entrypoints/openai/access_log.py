"""The server's access log (replaces uvicorn's): one line per HTTP request, written when its
response has been sent (a stream: after its last event), on the ``atlas_vlm.access`` logger:

    127.0.0.1:51234 "POST /v1/chat/completions" 200 prompt_tokens=21 completion_tokens=8
        ttft=0.084s total=0.213s request_id=chatcmpl-4f0c...

(one line in the log). ``prompt_tokens`` / ``completion_tokens`` are summed over the engine
requests the HTTP request started (a prompt counted once, whatever ``n``; ``-`` for a route
that ran none), ``ttft`` is seconds from arrival to the first generated token (``-`` if none),
``total`` seconds from the request's first byte to its response's last, ``request_id`` the
response id (else the client's ``X-Request-Id``, else ``-``). A 4xx / 5xx line ends with
``error="message"`` (the error JSON's message). 5xx lines are warnings, the rest info.

How the counts get here: ``AccessLogMiddleware`` (plain ASGI, outermost) puts an
``AccessRecord`` in a context variable; ``serving_common.start_choices`` hands it the
``RequestStream``s it starts (``record_streams``); the engine thread fills their
``RequestStreamState`` (``first_token_time``, the engine ``Request``'s token counts).
"""

from __future__ import annotations

import contextvars
import json
import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger("atlas_vlm.access")
MAX_ERROR_BODY_BYTES = 16 * 1024  # error JSON kept to read its message from


@dataclass
class AccessRecord:
    """What one HTTP request started in the engine (see the module docstring)."""

    request_id: str | None = None
    streams: list = field(default_factory=list)  # (RequestStreamState, counts its prompt)
    closed: bool = False  # logged: a background task's later requests are not its own


_current: contextvars.ContextVar[AccessRecord | None] = contextvars.ContextVar("atlas_access_record", default=None)


def record_streams(request_id: str, streams: list, counts_prompt: bool = True) -> None:
    """Add ``streams`` (``RequestStream``s just started) to the current HTTP request's record;
    the first id given names the request. No-op outside a logged request."""
    rec = _current.get()
    if rec is None or rec.closed:
        return
    rec.request_id = rec.request_id or request_id
    for s in streams:
        state = getattr(s, "state", None)  # None: a remote engine's stream (Ray replicas)
        if state is not None:
            rec.streams.append((state, counts_prompt))


def _counts(rec: AccessRecord) -> tuple[str, str, str]:
    """``(prompt_tokens, completion_tokens, ttft)`` as logged (``-`` where not applicable)."""
    if not rec.streams:
        return "-", "-", "-"
    prompt = completion = 0
    first: list[float] = []
    for state, counts_prompt in rec.streams:
        req = state.request
        if req is not None:
            prompt += req.num_prompt_tokens if counts_prompt else 0
            completion += req.num_output_tokens
        if state.first_token_time is not None:
            first.append(state.first_token_time - state.arrival)
    return str(prompt), str(completion), f"{min(first):.3f}s" if first else "-"


def _error_message(body: bytes) -> str:
    try:
        err = json.loads(body).get("error")
        msg = err.get("message") if isinstance(err, dict) else err
        return str(msg) if msg is not None else body[:200].decode("utf-8", "replace")
    except (ValueError, AttributeError):
        return body[:200].decode("utf-8", "replace")


class AccessLogMiddleware:
    """Plain ASGI middleware writing the access line of every HTTP request (see the module
    docstring); it wraps ``send`` only, so disconnects stay visible to the routes."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, rec = time.monotonic(), AccessRecord()
        token = _current.set(rec)
        seen = {"status": None, "body": bytearray()}

        async def logged_send(message):
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
            elif message["type"] == "http.response.body" and (seen["status"] or 200) >= 400 \
                    and len(seen["body"]) < MAX_ERROR_BODY_BYTES:
                seen["body"] += message.get("body", b"")
            await send(message)

        failure = None
        try:
            await self.app(scope, receive, logged_send)
        except BaseException as e:  # logged, then re-raised (uvicorn / Starlette answer it)
            failure = e
            raise
        finally:
            _current.reset(token)
            rec.closed = True
            self._log(scope, rec, seen, time.monotonic() - start, failure)

    @staticmethod
    def _log(scope, rec: AccessRecord, seen: dict, total_s: float, failure: BaseException | None) -> None:
        status = seen["status"] or (500 if failure is not None else 0)
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "-"
        rid = rec.request_id or dict(scope.get("headers") or ()).get(b"x-request-id", b"-").decode("latin-1")
        prompt, completion, ttft = _counts(rec)
        line = (f'{who} "{scope.get("method", "-")} {scope.get("path", "-")}" {status} prompt_tokens={prompt} '
                f"completion_tokens={completion} ttft={ttft} total={total_s:.3f}s request_id={rid}")
        if status >= 400:
            msg = _error_message(bytes(seen["body"])) if seen["body"] else \
                f"{type(failure).__name__}" if failure is not None else ""
            line += f" error={json.dumps(msg, ensure_ascii=False)}"
        logger.log(logging.WARNING if status >= 500 else logging.INFO, "%s", line)
