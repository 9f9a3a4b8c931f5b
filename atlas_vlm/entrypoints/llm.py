"""``LLM``: the library facade (``from atlas_vlm import LLM, SamplingParams``)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

from tqdm.auto import tqdm

from atlas_vlm.config import EngineConfig
from atlas_vlm.default_models import default_text_model
from atlas_vlm.engine import LLMEngine
from atlas_vlm.outputs import RequestOutput
from atlas_vlm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLM:
    """Load a model and generate.

    Args:
        model: HF model folder, ``.gguf`` file or Hub id ``ORG/NAME`` (fetched through
            ``huggingface_hub``'s cache; ``revision=`` picks a branch/tag/commit); ``None`` uses
            the embedded SmolLM2-135M-Instruct.
        **kwargs: any ``EngineConfig`` field (``kv_cache="paged" | "contiguous"``,
            ``kvcache_block_size``, ``max_model_len``, ``max_pixels``, ...).

    Example::

        llm = LLM()
        out = llm.generate(["What is the capital of France?"], SamplingParams(temperature=0))
        print(out[0].text)
    """

    def __init__(self, model: str | None = None, **kwargs):
        self.config = EngineConfig(model=model or default_text_model(), **kwargs)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 stream: bool = False, use_tqdm: bool = True) -> list[RequestOutput] | Iterator[RequestOutput]:
        """Generate for one prompt or a list of prompts, all batched together.

        A prompt is a str, a list of token ids, or a dict with ``prompt``,
        ``prompt_token_ids`` or ``messages`` (chat messages, images allowed) and optional
        ``mm_options`` (``{"max_pixels": N, "min_pixels": N}``).

        Returns:
            one ``RequestOutput`` per prompt, in order. With a list, a prompt that is
            rejected (bad image, too long, ...) gets ``finish_reason="error"`` and ``error``
            set while the others run; a single prompt's error is raised instead.
            With ``stream=True``: an iterator of ``RequestOutput`` per request per step
            (``new_text`` / ``new_token_ids`` hold what the step added).
        """
        single = not isinstance(prompts, list) or (bool(prompts) and isinstance(prompts[0], int))
        prompts = [prompts] if single else prompts
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids, outputs = [], {}
        for prompt, p in zip(prompts, params):
            try:
                ids.append(self.engine.add_request(prompt, p))
            except (ValueError, TypeError, OSError) as e:
                if single:
                    raise
                logger.warning("request rejected: %s", e)
                rid = f"rejected-{len(ids)}"
                ids.append(rid)
                outputs[rid] = RequestOutput(rid, prompt if isinstance(prompt, str) else None, [],
                                             finish_reason="error", error=str(e))
        stream_iter = self._run(ids, outputs, use_tqdm and not stream and not single)
        if stream:
            return stream_iter
        for _ in stream_iter:
            pass
        return [outputs[i] for i in ids]

    def _run(self, ids: list[str], outputs: dict[str, RequestOutput], use_tqdm: bool) -> Iterator[RequestOutput]:
        pending = set(ids) - set(outputs)
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm)
        bar.update(len(ids) - len(pending))
        try:
            while pending:
                for out in self.engine.step():
                    if out.request_id not in pending:
                        continue
                    outputs[out.request_id] = out
                    if out.finished:
                        pending.discard(out.request_id)
                        bar.update(1)
                    yield out
        finally:
            bar.close()
            for rid in pending:  # the caller stopped a stream early
                self.engine.abort_request(rid)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params=None, *,
             mm_options: dict | None = None, stream: bool = False, use_tqdm: bool = True):
        """Generate a reply to one conversation (or a list of them) with the tokenizer's
        chat template. Content may be a string or a list of ``{"type": "text"|"image", ...}``
        items (several images per message allowed)."""
        single = bool(messages) and isinstance(messages[0], dict)
        convs = [messages] if single else messages
        prompts = [{"messages": c, "mm_options": mm_options} for c in convs]
        result = self.generate(prompts if not single else prompts[0], sampling_params, stream=stream, use_tqdm=use_tqdm)
        return result
