"""``InputProcessor``: any prompt form -> a validated ``Request``.

Prompt forms (as vLLM's ``LLM.generate`` / ``LLM.chat`` take them): a str, a list of token
ids, ``{"prompt": str}``, ``{"prompt_token_ids": [int]}``, or a chat prompt
``{"messages": [...], "add_generation_prompt", "continue_final_message", "chat_template",
"chat_template_kwargs", "mm_options"}`` (see :mod:`atlas_vlm.engine.chat_input`). Here:
dispatch, the length checks (``max_model_len``, KV capacity, empty prompt), the request id
and the per-request seed. Nothing here allocates KV blocks.
"""

from __future__ import annotations

import functools
import itertools
import threading
from dataclasses import dataclass, field

import torch

from atlas_vlm.engine.chat_input import ChatInput
from atlas_vlm.engine.token_ids import as_token_ids, is_token_id_sequence
from atlas_vlm.inputs.media import RequestTooLongError
from atlas_vlm.request import Request
from atlas_vlm.pooling_params import PoolingParams
from atlas_vlm.sampling_params import RequestOutputKind, SamplingParams
from mm_kv_cache_management import PlaceholderRange, media_items


@dataclass
class ProcessedPrompt:
    """A prompt ready to become a request: ids with placeholders expanded, its media items
    (any modality, prompt order) and their placeholder runs, and its positions."""

    prompt_token_ids: list[int]  # placeholders expanded
    prompt: str | None = None  # text form, when known
    mm_items: list = field(default_factory=list)  # ProcessedImage / ProcessedVideo / tiles, prompt order
    mm_positions: list[PlaceholderRange] = field(default_factory=list)  # placeholder runs, by offset
    mrope_positions: torch.Tensor | None = None  # [3, num_tokens], M-RoPE models only
    rope_delta: int = 0  # M-RoPE decode offset

    @property
    def images(self) -> list:
        """The image items (SmolVLM: image tiles), in prompt order."""
        return [item for item in self.mm_items if item.modality == "image"]

    @property
    def videos(self) -> list:
        """The video items (SmolVLM: video frames), in prompt order."""
        return [item for item in self.mm_items if item.modality == "video"]

    @property
    def image_spans(self) -> list[PlaceholderRange]:
        """The placeholder runs of images."""
        return [r for r in self.mm_positions if r.modality == "image"]


def placeholder_ranges(token_ids: list[int], items: list, placeholder_ids: dict[str, int]) -> list[PlaceholderRange]:
    """The placeholder runs of every media item, items in prompt order.

    Item ``k`` takes the next runs of its modality's placeholder token until its
    ``num_tokens`` encoder rows are placed: one run for an image, one per temporal group for
    a Qwen3-VL video (timestamp text between), a run may also hold several adjacent items.

    Raises:
        ValueError: the prompt has fewer or more placeholder tokens than the items need
            (the message gives both counts per modality).
    """
    ranges, i, n = [], 0, len(token_ids)

    def mismatch() -> ValueError:
        counts = {m: sum(1 for t in token_ids if t == tok) for m, tok in placeholder_ids.items()}
        needed = {m: sum(it.num_tokens for it in items if placeholder_ids[it.modality] == tok)
                  for m, tok in placeholder_ids.items()}
        return ValueError(f"prompt holds placeholder tokens {counts} but its media items need {needed}; "
                          "pass images and videos through chat messages")

    for k, item in enumerate(items):
        token, placed = placeholder_ids[item.modality], 0
        while placed < item.num_tokens:
            while i < n and token_ids[i] != token:
                i += 1
            if i == n:
                raise mismatch()
            j = i
            while j < n and token_ids[j] == token and j - i < item.num_tokens - placed:
                j += 1
            ranges.append(PlaceholderRange(i, j - i, item.content_hash, item.modality, k, placed))
            placed, i = placed + j - i, j
    tokens = set(placeholder_ids.values())
    if sum(1 for t in token_ids if t in tokens) != sum(r.length for r in ranges):
        raise mismatch()
    return ranges


def media_summary(items: list) -> str:
    """Each media item of a prompt in words, for errors: ``"video 0 (clip.mp4): 6 frames, 390
    tokens; image 0: 256 tokens"`` (SmolVLM's tiles and frames counted per image / video)."""
    groups: dict[tuple[str, object], list] = {}
    for k, item in enumerate(items):  # a SmolVLM image's tiles / a video's frames share their index
        key = getattr(item, "image_index", getattr(item, "video_index", k))
        groups.setdefault((item.modality, key), []).append(item)
    parts, counts = [], {"image": 0, "video": 0}
    for (modality, _), members in groups.items():
        source = getattr(members[0], "source", "")
        name = f"{modality} {counts[modality]}" + (f" ({source})" if source else "")
        counts[modality] += 1
        tokens = sum(m.num_tokens for m in members)
        if modality == "video":
            frames = len(getattr(members[0], "frame_indices", members))
            parts.append(f"{name}: {frames} frames, {tokens} tokens")
        else:
            parts.append(f"{name}: {tokens} tokens")
    return "; ".join(parts)


class SerializedTokenizer:
    """A tokenizer whose calls run one at a time (one re-entrant lock per tokenizer).

    Why: a fast tokenizer keeps per-call settings in its shared Rust object (transformers
    sets ``encode_special_tokens`` for ``split_special_tokens=...``, and truncation/padding);
    two threads encoding at once then either fail (``RuntimeError: Already borrowed``) or
    encode with the other call's setting. Input workers prepare requests concurrently, so
    the input path goes through this wrapper; decoding elsewhere (which changes no setting)
    needs no lock. Every attribute is the tokenizer's; methods and calls take the lock.
    """

    def __init__(self, tokenizer):
        object.__setattr__(self, "_tokenizer", tokenizer)
        object.__setattr__(self, "_lock", threading.RLock())

    @property
    def wrapped(self):
        """The tokenizer itself."""
        return self._tokenizer

    def __call__(self, *args, **kwargs):
        with self._lock:
            return self._tokenizer(*args, **kwargs)

    def __getattr__(self, name: str):
        value = getattr(self._tokenizer, name)
        if not callable(value) or isinstance(value, type):
            return value

        @functools.wraps(value)
        def locked(*args, **kwargs):
            with self._lock:
                return value(*args, **kwargs)
        return locked

    def __setattr__(self, name: str, value) -> None:
        setattr(self._tokenizer, name, value)


def _check_keys(prompt: dict, allowed: set[str], form: str) -> None:
    unknown = sorted(str(k) for k in prompt if k not in allowed)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in a {form!r} prompt dict; allowed: {sorted(allowed)}")


class InputProcessor:
    """Prompt preparation and request validation for ``LLMEngine.add_request``.

    Args:
        tokenizer: the model's transformers tokenizer.
        hf_config: the model's transformers config (image token ids, merge size).
        config: ``EngineConfig`` (pixel bounds, http limits, ``seed``).
        vocab_size: the model's vocabulary size (embedding rows; may exceed the tokenizer's).
        max_model_len: tokens per request (prompt + output).
        block_manager: read for the KV capacity (``num_blocks``, ``num_blocks_needed``).
        device: where each request's sampling ``torch.Generator`` lives.
        image_settings: the checkpoint's ``ImageProcessorSettings`` (see ``ChatInput``).
    """

    def __init__(self, tokenizer, hf_config, config, vocab_size: int, max_model_len: int,
                 block_manager, device: torch.device | str = "cpu", image_settings=None):
        # input workers prepare requests at once (AsyncLLM): one tokenizer call at a time
        self.tokenizer = tokenizer if isinstance(tokenizer, SerializedTokenizer) else SerializedTokenizer(tokenizer)
        self.hf_config = hf_config
        self.config = config
        self.vocab_size = vocab_size  # rows of the model's embedding: the valid token ids
        self.max_model_len = max_model_len
        self.block_manager = block_manager
        self.device = device
        self.chat = ChatInput(self.tokenizer, config, hf_config, image_settings, max_model_len)
        self._ids = itertools.count()  # default request ids
        self._seeds = itertools.count()  # default seeds: engine seed + arrival index

    # ---- prompt forms -----------------------------------------------------------------
    def process_prompt(self, prompt) -> ProcessedPrompt:
        """str | token ids (list, 1-D integer numpy array / torch tensor) | prompt dict ->
        ``ProcessedPrompt`` (ids, images, positions).

        Raises:
            TypeError: not a prompt form.
            ValueError: an unknown key in the prompt dict (named), bad token ids, or a bad
                chat prompt (see ``ChatInput.process``).
            mm_token_pipeline.ImageInputError: an image cannot be loaded or resized.
        """
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        if isinstance(prompt, str):
            return self.from_text(prompt)
        if isinstance(prompt, list) or is_token_id_sequence(prompt):
            return self.from_token_ids(prompt)
        if isinstance(prompt, dict):
            if prompt.get("mm_options") is not None and "messages" not in prompt:
                raise ValueError("mm_options applies to chat prompts ({'messages': ...}) only")
            if "messages" in prompt:
                ids, items = self.chat.process(prompt)
                return self._finish(ProcessedPrompt(ids, mm_items=items))
            if "prompt_token_ids" in prompt:
                _check_keys(prompt, {"prompt_token_ids", "mm_options"}, "prompt_token_ids")
                return self.from_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                _check_keys(prompt, {"prompt", "mm_options"}, "prompt")
                return self.from_text(prompt["prompt"])
        raise TypeError(f"a prompt is a str, a list of token ids or a dict with 'prompt', "
                        f"'prompt_token_ids' or 'messages'; got {type(prompt).__name__} {prompt!r:.60}")

    def from_text(self, prompt: str) -> ProcessedPrompt:
        if not isinstance(prompt, str):
            raise TypeError(f"'prompt' must be a str, got {type(prompt).__name__}")
        ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        return self._finish(ProcessedPrompt(list(ids), prompt=prompt))

    def from_token_ids(self, ids) -> ProcessedPrompt:
        """A token-id prompt: any 1-D integer sequence (list, numpy array, torch tensor;
        ``token_ids.as_token_ids``). Raises ValueError naming ``prompt_token_ids``."""
        return self._finish(ProcessedPrompt(as_token_ids(ids, self.vocab_size)))

    def _finish(self, p: ProcessedPrompt) -> ProcessedPrompt:
        """Placeholder runs and positions of a prompt for a multimodal model (the family's
        ``MediaInputs``); text models pass through."""
        media = self.chat.media
        if media is None:
            return p
        p.mm_positions = placeholder_ranges(p.prompt_token_ids, p.mm_items, media.placeholder_token_ids())
        p.mrope_positions, p.rope_delta = media.positions(p.prompt_token_ids, p.mm_items)
        return p

    # ---- requests ---------------------------------------------------------------------
    def process(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> Request:
        """Turn one prompt into a ``Request`` ready for the scheduler.

        ``max_tokens=None`` resolves to what is left of ``max_model_len``; a request with
        ``seed=None`` is seeded with ``model_config.seed + arrival index`` (reproducible runs).
        ``params`` may be a ``PoolingParams``: an embedding request (its prompt only; the
        prompt must leave room for one token below ``max_model_len``, as any prompt).

        Raises (nothing is allocated):
            RequestTooLongError: prompt (+ ``max_tokens``) over ``max_model_len`` or the KV capacity.
            ValueError: empty prompt, or any malformed input (see :meth:`process_prompt`).
            TypeError: not a prompt form, or ``params`` not a ``SamplingParams`` or ``PoolingParams``.
        """
        params = SamplingParams() if params is None else params
        pooling = None
        if isinstance(params, PoolingParams):  # prompt only: one output at the end, no sampling
            pooling, params = params, SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)
        p, max_tokens = self._checked(prompt, params)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(params.seed if params.seed is not None else self.config.model_config.seed + next(self._seeds))
        return Request(
            request_id=request_id if request_id is not None else str(next(self._ids)),
            token_ids=list(p.prompt_token_ids), mm_features=media_items(p.mm_positions, p.mm_items),
            rope_delta=p.rope_delta, sampling_params=params, prompt=p.prompt, max_tokens=max_tokens,
            mrope_positions=p.mrope_positions, generator=generator, pooling_params=pooling,
        )

    def validate(self, prompt, params: SamplingParams | None = None) -> ProcessedPrompt:
        """Every check of :meth:`process` without making a ``Request`` (no request id or seed
        is used up): the ``ProcessedPrompt`` to pass to ``process`` later. Raises as ``process``."""
        return self._checked(prompt, SamplingParams() if params is None else params)[0]

    def _checked(self, prompt, params: SamplingParams) -> tuple[ProcessedPrompt, int]:
        if isinstance(params, PoolingParams):
            params = SamplingParams(max_tokens=1)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams or PoolingParams, got {type(params).__name__}")
        p = self.process_prompt(prompt)
        try:
            return p, self._check_length(len(p.prompt_token_ids), params.max_tokens)
        except RequestTooLongError as e:
            if p.mm_items:
                raise RequestTooLongError(f"{e}; its media: {media_summary(p.mm_items)}") from None
            raise

    def _check_length(self, num_prompt: int, max_tokens: int | None) -> int:
        """Resolved ``max_tokens``; raises if the request can never run."""
        if num_prompt == 0:
            raise ValueError("the prompt is empty")
        if num_prompt >= self.max_model_len:
            raise RequestTooLongError(
                f"prompt is {num_prompt} tokens (text and media tokens together); max_model_len is "
                f"{self.max_model_len}, which must leave room for at least one generated token"
            )
        max_tokens = max_tokens or (self.max_model_len - num_prompt)
        if num_prompt + max_tokens > self.max_model_len:
            raise RequestTooLongError(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = {num_prompt + max_tokens} "
                f"is over max_model_len {self.max_model_len}"
            )
        bm = self.block_manager
        if bm.num_blocks_needed(num_prompt + max_tokens) > bm.num_blocks:
            raise RequestTooLongError(
                f"prompt ({num_prompt}) + max_tokens ({max_tokens}) tokens can never fit the KV cache "
                f"({bm.num_blocks} blocks, {bm.num_blocks * bm.block_size} tokens)"
            )
        return max_tokens
