"""``LLM``: the library facade (``from atlas_vlm import LLM, SamplingParams``).

Calls may overlap: several live stream iterators, or calls from several threads, share the
engine through one ``OutputRouter`` (serialised stepping, each output to its own call).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import queue
from collections.abc import Iterator

from tqdm.auto import tqdm

from atlas_vlm.config import EngineConfig
from atlas_vlm.default_models import default_text_model
from atlas_vlm.engine import LLMEngine
from atlas_vlm.engine.token_ids import is_token_id_sequence
from atlas_vlm.entrypoints.chat_split import split_output
from atlas_vlm.entrypoints.router import OutputRouter
from atlas_vlm.lora.request import as_lora_requests
from atlas_vlm.outputs import RequestOutput
from atlas_vlm.pooling_params import PoolingParams
from atlas_vlm.sampling_params import RequestOutputKind, SamplingParams
from mm_token_pipeline import MultiModalOptions

logger = logging.getLogger(__name__)


def _finish_chat(out: RequestOutput, reasoning_parser=None, tool_parser=None) -> RequestOutput:
    """A finished chat output with ``reasoning_content`` / ``content`` split by the engine's
    reasoning parser (if any) and ``tool_calls`` parsed from the content by ``tool_parser``
    (an ``atlas_vlm.tool_parsers.ToolParser``; None: no tool parsing); the server's split
    (``entrypoints.chat_split.split_output``, the one split)."""
    if not out.finished or out.finish_reason == "error":
        return out
    state = reasoning_parser.initial_state(out.prompt_token_ids) if reasoning_parser is not None else None
    reasoning, content, calls = split_output(out.text, reasoning_parser, state, tool_parser)
    split = {}  # a new output: the engine's finished output is never written after the fact
    if reasoning_parser is not None:
        split.update(reasoning_content=reasoning, content=content)
    if tool_parser is not None:
        split.update(tool_calls=calls, finish_reason="tool_calls" if calls and out.finish_reason == "stop"
                     else out.finish_reason)
    return dataclasses.replace(out, **split) if split else out


def _final_only(params):
    """``params`` (a ``SamplingParams`` or None) as a copy with ``output_kind=FINAL_ONLY``;
    anything else unchanged (the engine names what is wrong with it)."""
    if params is None:
        return SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY)
    if isinstance(params, SamplingParams):  # a plain copy: its values are checked where the engine takes them
        params = copy.copy(params)
        object.__setattr__(params, "output_kind", RequestOutputKind.FINAL_ONLY)
    return params


def _check_chat_stream_kind(sampling_params, stream: bool) -> None:
    """Raises ValueError: a streamed chat whose outputs get a reasoning / tool-call split asks
    for DELTA outputs (the split needs the whole text; stream CUMULATIVE outputs instead)."""
    params = sampling_params if isinstance(sampling_params, list) else [sampling_params]
    if stream and any(getattr(p, "output_kind", None) is RequestOutputKind.DELTA for p in params):
        raise ValueError("sampling_params.output_kind=DELTA cannot be streamed by LLM.chat with a reasoning "
                         "parser or tools (the split needs the whole text); use CUMULATIVE")


class LLM:
    """Load a model and generate.

    Args:
        model: HF model folder, ``.gguf`` file or Hub id ``ORG/NAME`` (fetched through
            ``huggingface_hub``'s cache; ``revision=`` picks a branch/tag/commit); ``None`` uses
            the embedded SmolLM2-135M-Instruct.
        **kwargs: any flat ``EngineConfig`` keyword (``EngineConfig.flat_names()``, routed to its
            sub-config; docs/library.md#where-settings-live), e.g. ``kv_cache="paged" | "contiguous"``,
            ``kvcache_block_size``, ``max_model_len``, ``max_pixels``, ``allow_http_images``,
            ``http_image_timeout_s``, ``http_image_max_bytes``, ``tool_call_parser`` (a
            ``atlas_vlm.tool_parsers`` name; None: detected from the chat template),
            ``speculative="ngram" | "mtp"`` with ``num_speculative_tokens`` (exact speculative
            decoding, docs/speculative.md), ``deterministic=True`` (each request's tokens and
            logprobs independent of its batch, docs/deterministic.md), ...).

    Example::

        llm = LLM()
        out = llm.generate(["What is the capital of France?"], SamplingParams(temperature=0))
        print(out[0].text)
    """

    def __init__(self, model: str | None = None, **kwargs):
        self.config = EngineConfig(model=model or default_text_model(), **kwargs)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer
        self.router = OutputRouter(self.engine)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 stream: bool = False, use_tqdm: bool = True,
                 lora_request=None) -> list[RequestOutput] | Iterator[RequestOutput]:
        """Generate for one prompt or a list of prompts, all batched together.

        A prompt is a str, token ids (a list, or a 1-D integer numpy array / torch tensor), ``{"prompt": str}``,
        ``{"prompt_token_ids": [int]}``, or a chat prompt ``{"messages": [...],
        "add_generation_prompt", "continue_final_message", "chat_template",
        "chat_template_kwargs", "mm_options"}`` (see :meth:`chat`); an unknown key is refused.

        Returns:
            one ``RequestOutput`` per prompt, in order. With a list, a prompt that is
            rejected (bad image, too long, ...) gets ``finish_reason="error"`` and ``error``
            set while the others run; a single prompt's error is raised instead.
            With ``stream=True``: an iterator of ``RequestOutput`` per request per step
            (``new_text`` / ``new_token_ids`` hold what the step added; with
            ``SamplingParams(output_kind=RequestOutputKind.DELTA)`` every field holds only
            the step's delta); closing it early aborts its unfinished requests. Without
            ``stream`` only final outputs are made (``output_kind`` is FINAL_ONLY, as vLLM's
            ``LLM.generate``). A request aborted from anywhere
            (``llm.engine.abort_request``) ends with ``finish_reason="abort"``.

        ``lora_request``: an ``atlas_vlm.LoRARequest`` for every prompt, a list of one per
        prompt (None: the base model), or None; needs ``LLM(..., enable_lora=True)``.

        Thread-safe: calls from several threads (and several live streams) share the engine;
        each gets exactly its own requests' outputs.
        """
        single = not isinstance(prompts, list) or is_token_id_sequence(prompts)
        prompts = [prompts] if single else prompts
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        if not stream:  # only the final outputs are read: make no per-step output at all
            params = [_final_only(p) for p in params]
        ids, outputs, q = [], {}, queue.SimpleQueue()
        for prompt, p, lora in zip(prompts, params, as_lora_requests(lora_request, len(prompts))):
            try:
                ids.append(self.router.add_request(prompt, p, q, lora))
            except (ValueError, TypeError, OSError) as e:
                if single:
                    self._abort(ids)
                    raise
                logger.warning("request rejected: %s", e)
                rid = f"rejected-{len(ids)}"
                ids.append(rid)
                outputs[rid] = RequestOutput(rid, prompt if isinstance(prompt, str) else None, [],
                                             finish_reason="error", error=str(e))
        stream_iter = self._run(ids, outputs, q, use_tqdm and not stream and not single)
        if stream:
            return stream_iter
        for _ in stream_iter:
            pass
        return [outputs[i] for i in ids]

    def _abort(self, ids) -> None:
        for rid in ids:
            self.engine.abort_request(rid)
        self.router.unregister(ids)

    def _run(self, ids: list[str], outputs: dict[str, RequestOutput], q: queue.SimpleQueue,
             use_tqdm: bool) -> Iterator[RequestOutput]:
        pending = set(ids) - set(outputs)
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm)
        bar.update(len(ids) - len(pending))
        try:
            while pending:
                out = self.router.next_output(q, pending)
                if out.request_id not in pending:
                    continue
                outputs[out.request_id] = out
                if out.finished:
                    pending.discard(out.request_id)
                    bar.update(1)
                yield out
        finally:
            bar.close()
            self._abort(pending)  # the caller stopped a stream early
            self.router.unregister(ids)

    def reset_mm_cache(self) -> None:
        """Drop the encoder outputs no running request needs (vLLM's ``LLM.reset_mm_cache``): the
        next request with the same image or video runs the vision tower again."""
        self.engine.reset_mm_cache()

    def embed(self, prompts, pooling_params: PoolingParams | list[PoolingParams] | None = None, *,
              use_tqdm: bool = True) -> list[RequestOutput]:
        """Embed one prompt or a list of prompts (vLLM's ``LLM.embed``), batched together
        and with any generation running on the same engine.

        Args:
            prompts: the prompt forms of :meth:`generate`: a str, token ids,
                ``{"prompt": str}``, ``{"prompt_token_ids": [int]}`` or a chat prompt
                ``{"messages": [...], "add_generation_prompt", "mm_options", ...}`` (images on a
                VLM); the text goes in as given (no chat template unless ``messages``).
            pooling_params: a ``PoolingParams`` for all, one per prompt, or None (last-token
                pooling, L2-normalised, every dimension).

        Returns:
            one ``RequestOutput`` per prompt, in order, whose ``embedding`` is the vector (a
            list of ``dimensions`` floats, or the hidden size) and ``prompt_token_ids`` the
            ids it saw; with a list, a rejected prompt gets ``finish_reason="error"`` and
            ``error`` (``embedding`` None) while the others run; a single prompt's error is raised.

        Raises:
            TypeError: ``pooling_params`` not a ``PoolingParams`` (or a list of them).
            ValueError: as :meth:`generate`; ``dimensions`` over the model's hidden size.
        """
        params = pooling_params if isinstance(pooling_params, list) else [pooling_params]
        for p in params:
            if p is not None and not isinstance(p, PoolingParams):
                raise TypeError(f"pooling_params must be a PoolingParams, got {type(p).__name__}")
        if isinstance(pooling_params, list):
            pooling_params = [p or PoolingParams() for p in pooling_params]
        return self.generate(prompts, pooling_params or PoolingParams(), use_tqdm=use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params=None, *,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template: str | None = None, chat_template_kwargs: dict | None = None,
             mm_options: MultiModalOptions | dict | None = None, stream: bool = False, use_tqdm: bool = True,
             tools: list[dict] | None = None, tool_choice: str | dict = "auto", parallel_tool_calls: bool = True,
             lora_request=None):
        """Generate a reply to one conversation (or a list of them) through the chat template,
        as vLLM's ``LLM.chat``.

        Args:
            messages: ``[{"role": "system"|"user"|"assistant"|"tool", "content": ...}]``;
                content is a str, ``None`` or a list of ``{"type": "text"|"image"|"image_url", ...}``
                items (several images per message allowed on a VLM; text parts are joined with
                ``"\n"`` for text-only templates, as vLLM does).
            add_generation_prompt: open an assistant turn after the last message.
            continue_final_message: continue the last message instead (assistant prefill: no
                end-of-turn is added); needs ``add_generation_prompt=False``.
            chat_template: a Jinja template used instead of the tokenizer's.
            chat_template_kwargs: extra variables for the template.
            mm_options: ``MultiModalOptions`` (or a dict of its fields) for the images.
            tools: OpenAI tool definitions (``{"type": "function", "function": {"name",
                "description", "parameters"}}``), rendered by the model's chat template (one
                that ignores them gets Qwen2.5's ``# Tools`` block in the system message:
                ``atlas_vlm/inputs/tool_prompt.py``).
            tool_choice: "auto" (the model decides), "none" (no parsing), "required" or
                ``{"type": "function", "function": {"name": N}}``: the output is forced by a
                grammar into calls whose arguments follow the parameters schema, in the tool
                parser's format (``hermes``, ``llama3_json``, ``mistral``; ``qwen3_coder``
                refuses). Calls are read by ``LLM(tool_call_parser=...)``'s parser, else by the
                one the chat template points to (``chat_template`` if given).
            parallel_tool_calls: "required" may produce several calls.
            lora_request: as :meth:`generate` (one ``LoRARequest``, one per conversation, or None).

        Returns: as :meth:`generate`; with a reasoning parser (``LLM(reasoning_parser="qwen3")``)
        every finished output also has ``reasoning_content`` (the thinking, or None) and
        ``content`` (the rest; ``text`` stays whole); with ``tools`` (and ``tool_choice`` not "none") every
        finished output has ``tool_calls`` (OpenAI's shape: id, type, function name and
        arguments JSON text; ``[]`` if none; a call cut by ``max_tokens`` is dropped, the complete
        ones kept) and ``finish_reason="tool_calls"`` when it called and stopped.

        Raises:
            ValueError, TypeError: a malformed conversation or option (the message names it);
                ``tool_choice`` "required" / named with the ``qwen3_coder`` tool parser.
        """
        single = bool(messages) and isinstance(messages[0], dict)
        convs = [messages] if single else messages
        prompts = [{"messages": c, "add_generation_prompt": add_generation_prompt,
                    "continue_final_message": continue_final_message, "chat_template": chat_template,
                    "chat_template_kwargs": chat_template_kwargs, "mm_options": mm_options,
                    **({"tools": tools} if tools else {})} for c in convs]
        parser = self.engine.reasoning_parser
        if parser is not None or (tools and tool_choice != "none"):
            _check_chat_stream_kind(sampling_params, stream)
        if not tools or tool_choice == "none":
            result = self.generate(prompts[0] if single else prompts, sampling_params, stream=stream, use_tqdm=use_tqdm,
                               lora_request=lora_request)
            if parser is None:
                return result
            if stream:
                return (_finish_chat(o, parser) for o in result)
            return [_finish_chat(o, parser) for o in result]
        from atlas_vlm.tool_parsers import forced_tool_calls, resolve_tool_parser

        parser_cls = resolve_tool_parser(self.config.model_config.tool_call_parser,
                                         chat_template or getattr(self.tokenizer, "chat_template", None))
        forced = forced_tool_calls(parser_cls, tools, tool_choice, parallel_tool_calls, self.tokenizer)
        if forced is not None:
            base = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(convs)
            sampling_params = [dataclasses.replace(p or SamplingParams(), structured_outputs=forced) for p in base]
        result = self.generate(prompts[0] if single else prompts, sampling_params, stream=stream, use_tqdm=use_tqdm,
                               lora_request=lora_request)
        if stream:
            return (_finish_chat(o, parser, parser_cls(tools)) for o in result)
        return [_finish_chat(o, parser, parser_cls(tools)) for o in result]
