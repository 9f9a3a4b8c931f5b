"""``POST /v1/responses`` (OpenAI's Responses API) on the chat-completions machinery: the
request is translated to a chat request (``translate.chat_request``), prepared and run as
``/v1/chat/completions`` runs it (``serving_chat.prepare_chat``, ``start_choices``), and the
same outputs (``ChatChoiceOutput``) are formatted as a ``response`` object or its stream
of events (``stream.response_events``). ``store`` keeps the answer for ``GET``, ``DELETE``
and ``previous_response_id``."""

from __future__ import annotations

from atlas_vlm.entrypoints.openai.protocol import APIError
from atlas_vlm.entrypoints.openai.responses.output import (finish_status, item_id, output_items, response_object,
                                                           usage)
from atlas_vlm.entrypoints.openai.responses.protocol import ResponsesRequest
from atlas_vlm.entrypoints.openai.responses.store import ResponseStore
from atlas_vlm.entrypoints.openai.responses.stream import response_events
from atlas_vlm.entrypoints.openai.responses.translate import (FileReader, assistant_message, chat_request,
                                                              input_messages, responses_param)
from atlas_vlm.entrypoints.openai.serving_chat import prepare_chat
from atlas_vlm.entrypoints.openai.serving_common import ServerContext, close_all, collect, start_choices


def _as_responses(e: APIError) -> APIError:
    """``e`` with its param named as the Responses request names it."""
    message = e.message
    if e.param and message.startswith(e.param):  # the message leads with the field: named as Responses names it
        message = responses_param(e.param) + message[len(e.param):]
    return APIError(e.status, message, responses_param(e.param), e.code, e.headers)


class Finisher:
    """What happens to a finished answer: the ``response`` object completed with its output
    and usage, and stored (``store: true``) with its conversation."""

    def __init__(self, store: ResponseStore, req: ResponsesRequest, history: list[dict], inputs: list[dict],
                 base: dict):
        self.store, self.req, self.history, self.inputs, self.base = store, req, history, inputs, base

    def finish(self, out, items: list[dict], cached_tokens: int) -> dict:
        """The completed response object for the final (folded) ``RequestOutput`` ``out``."""
        response = {**self.base, **finish_status(out.finish_reason, out.error), "output": items,
                    "usage": usage(len(out.prompt_token_ids), len(out.token_ids), cached_tokens)}
        if self.req.store:
            text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
            calls = [i for i in items if i["type"] == "function_call"]
            conversation = self.history + self.inputs + [assistant_message(text or None, calls)]
            self.store.put(response, conversation)
        return response


async def create_response(ctx: ServerContext, store: ResponseStore, req: ResponsesRequest,
                          read_file: FileReader | None = None, rid: str | None = None):
    """Returns the ``response`` object (a dict), or (``stream: true``) an async iterator of
    its SSE events (``response.created`` ... ``response.completed``). ``read_file``: the
    ``/v1/files`` bytes of an ``input_file`` part's ``file_id``; ``rid``: the response's id
    (a background response has one before it runs).

    Raises:
        APIError: 400 bad input (``param`` named as in the Responses request), 404 unknown
            model or ``previous_response_id``, 500 engine step failed, 503 queue full.
    """
    model = ctx.check_model(req.model)
    history = store.conversation(req.previous_response_id) if req.previous_response_id else []
    inputs = input_messages(req, read_file)
    chat = chat_request(req, history, inputs)
    rid = rid or item_id("resp")
    try:
        params, prompt, views = await prepare_chat(ctx, chat)
        iters, first = await start_choices(ctx, prompt, params, rid)
    except APIError as e:
        raise _as_responses(e) from e
    finisher = Finisher(store, req, history, inputs, response_object(rid, model, req))
    if req.stream:
        return response_events(iters[0], first, views[0], finisher)
    try:
        (final,) = await collect(iters)
    finally:
        await close_all(iters + [first])
    message, _ = views[0].message(final)
    return finisher.finish(final, output_items(message), first.num_cached_tokens)
