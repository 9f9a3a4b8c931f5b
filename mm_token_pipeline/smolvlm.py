"""SmolVLM2's part of the token pipeline (Idefics3 family): prompt ids and image tiles from
the HF ``SmolVLMProcessor``, the image bound in its own terms, and the vision tower.

Scope. The HF processor does all image work and writes the prompt: it resizes each image
so its longest edge is ``size["longest_edge"]`` (small images are scaled UP to it), cuts
it into ``max_image_size`` tiles plus one global view, and expands each ``<image>`` of
the chat text into ``<fake_token_around_image><row_i_col_j><image>*image_seq_len ...
<fake_token_around_image><global-img><image>*image_seq_len<fake_token_around_image>``.
We never rebuild that string. Each tile's run of ``image_seq_len`` ``<image>`` tokens is
contiguous, and HF's ``inputs_merger`` fills the k-th run with the k-th tile's features,
so the engine sees every TILE as one image item (:class:`SmolVLMTile`): spans, chunked
prefill, the encoder cache and prefix-cache hashes work per tile unchanged.

Bound. ``max_pixels`` maps to ``longest_edge = tile * floor(sqrt(max_pixels) / tile)``
(capped at the checkpoint's own ``size["longest_edge"]``): every resized image then has
area <= ``max_pixels`` and at most ``(longest_edge / tile)**2 + 1`` tiles, i.e.
``((longest_edge / tile)**2 + 1) * image_seq_len`` tokens. A bound below one tile is
refused (``ImageInputError``) before anything is allocated.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers.models.smolvlm.configuration_smolvlm import SmolVLMConfig
from transformers.models.smolvlm.modeling_smolvlm import SmolVLMConnector, SmolVLMModel, SmolVLMVisionTransformer
from transformers.initialization import no_init_weights

from .image_io import ImageInputError

__all__ = ["SmolVLMTile", "longest_edge_for", "smolvlm_prompt", "SmolVLMVisionEncoder"]


@dataclass
class SmolVLMTile:
    """One tile (or the global view) of an image, as the engine's image item.

    Attributes:
        pixel_values: ``[3, tile, tile]`` float32, normalised by the HF image processor.
        pixel_attention_mask: ``[tile, tile]`` bool, False on padding (global view).
        num_tokens: ``image_seq_len`` ``<image>`` tokens this tile fills.
        content_hash: sha256 hex of the pixel values and mask (prefix-cache identity).
        image_index: which image of the prompt the tile comes from (0-based).
        modality: ``"image"`` (class attribute; video frames are ``SmolVLMVideoFrame``).
    """

    modality: ClassVar[str] = "image"
    pixel_values: torch.Tensor
    pixel_attention_mask: torch.Tensor
    num_tokens: int
    content_hash: str
    image_index: int
    grid_thw: None = None  # no M-RoPE grid: SmolVLM's decoder uses 1-D RoPE


def longest_edge_for(max_pixels: int | None, longest_edge: int | None, *, tile: int, default: int) -> int:
    """SmolVLM's resize target (pixels) from a ``max_pixels`` area bound or a ``longest_edge``.

    ``longest_edge`` wins when given; else ``tile * floor(sqrt(max_pixels) / tile)``; both
    capped at ``default`` (the checkpoint's ``size["longest_edge"]``).

    Raises:
        ImageInputError: the bound is below one ``tile x tile`` tile (names the values).
    """
    if longest_edge is None:
        if max_pixels is None:
            return default
        longest_edge = tile * math.floor(math.isqrt(int(max_pixels)) / tile)
        if longest_edge < tile:
            raise ImageInputError("image", f"max_pixels {max_pixels} is below one {tile}x{tile} SmolVLM tile "
                                  f"({tile * tile} pixels)")
    if longest_edge < tile:
        raise ImageInputError("image", f"longest_edge {longest_edge} is below one SmolVLM tile of {tile} pixels")
    return min(int(longest_edge), default)


def _as_template_messages(messages: list[dict], videos: bool = False) -> list[dict]:
    """Messages with string content as one text item, every image item as ``{"type": "image"}``
    and (``videos=True``; else refused) every video item as ``{"type": "video"}`` (the form
    SmolVLM's chat template reads)."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) or content is None:
            content = [{"type": "text", "text": content or ""}]
        items = []
        for item in content:
            if item.get("type") in ("image", "image_url") or "image" in item or "image_url" in item:
                items.append({"type": "image"})
            elif item.get("type") in ("video", "video_url") or "video" in item or "video_url" in item:
                if not videos:
                    raise ValueError("video items need their videos: pass videos= (one per video item)")
                items.append({"type": "video"})
            else:
                items.append({"type": "text", "text": item.get("text", "")})
        out.append({"role": message["role"], "content": items})
    return out


def smolvlm_prompt(processor, messages: list[dict], images: list, longest_edge: int,
                   videos: list | None = None) -> tuple[list[int], list]:
    """Prompt ids and tower items of one chat request, all from the HF ``SmolVLMProcessor``.

    Args:
        processor: the checkpoint's ``SmolVLMProcessor`` (``AutoProcessor.from_pretrained``).
        messages: chat messages; image items in the order of ``images``, video items
            (``{"type": "video", "video": ...}``) in the order of ``videos``.
        images: RGB ``PIL.Image`` per image item.
        longest_edge: resize target in pixels of the images (:func:`longest_edge_for`).
        videos: per video item a ``SmolVLMVideo`` (``smolvlm_video.load_smolvlm_video``,
            SmolVLM's frame sampling) or a source loaded with the checkpoint's sampling
            defaults; ``None``: no video items (see ``smolvlm_video.smolvlm_video_prompt``).

    Returns:
        ``(ids [N], items)``; item k fills the k-th run of ``image_seq_len`` ``<image>``
        tokens: ``SmolVLMTile`` per image tile, ``SmolVLMVideoFrame`` per video frame.

    Raises:
        ValueError: the processor's token runs do not match its tiles (e.g. a literal
            ``<image>`` in user text), or video items without ``videos``.
        VideoInputError: a video that cannot be loaded or sampled (names the video).
    """
    if videos is not None:
        from .smolvlm_video import smolvlm_video_prompt

        return smolvlm_video_prompt(processor, messages, images, longest_edge, videos)
    text = processor.apply_chat_template(_as_template_messages(messages), add_generation_prompt=True, tokenize=False)
    # channels-last said explicitly: transformers guesses the layout from the array's shape,
    # and a 1- or 2-pixel-wide image (1, 1, 3) would read as channels-first
    kwargs = dict(images=images, size={"longest_edge": longest_edge}, input_data_format="channels_last") if images else {}
    out = processor(text=text, return_tensors="pt", **kwargs)
    ids = out["input_ids"][0].tolist()
    seq_len = processor.image_seq_len
    n_image_tokens = sum(1 for t in ids if t == processor.image_token_id)
    if not images:
        if n_image_tokens:
            raise ValueError(f"the prompt holds {n_image_tokens} <image> tokens but no image was given")
        return ids, []
    pixel_values = out["pixel_values"][0]  # [num_tiles, 3, tile, tile]
    masks = out["pixel_attention_mask"][0].bool()  # [num_tiles, tile, tile]
    if n_image_tokens != pixel_values.shape[0] * seq_len:
        raise ValueError(f"the prompt holds {n_image_tokens} <image> tokens but the images give "
                         f"{pixel_values.shape[0]} tiles of {seq_len}; is there a literal '<image>' in the text?")
    tiles_per_image = _tiles_per_image(ids, processor, len(images))
    owners = [i for i, n in enumerate(tiles_per_image) for _ in range(n)]
    tiles = []
    for k in range(pixel_values.shape[0]):
        digest = hashlib.sha256(pixel_values[k].float().numpy().tobytes())
        digest.update(masks[k].numpy().tobytes())
        tiles.append(SmolVLMTile(pixel_values[k].float(), masks[k], seq_len, digest.hexdigest(), owners[k]))
    return ids, tiles


def global_blocks(ids: list[int], processor) -> list[int]:
    """Per ``<global-img>`` block of the ids, in order, the ``<row_i_col_j>`` tiles before it
    (0 for a video frame or an unsplit image).

    Raises:
        ValueError: ``<row_i_col_j>`` tiles after the last global view (a literal image token
            in the text, most likely).
    """
    vocab = processor.tokenizer.get_added_vocab()  # token -> id
    row_col = {i for tok, i in vocab.items() if re.fullmatch(r"<row_\d+_col_\d+>", tok)}
    global_id = processor.tokenizer.convert_tokens_to_ids(processor.global_image_token)
    counts, current = [], 0
    for t in ids:
        if t in row_col:
            current += 1
        elif t == global_id:
            counts.append(current)
            current = 0
    if current:
        raise ValueError(f"the prompt holds {current} <row_i_col_j> tiles without a global view; is there a literal "
                         "image token in the text?")
    return counts


def _tiles_per_image(ids: list[int], processor, num_images: int) -> list[int]:
    """Tiles of each image: one per ``<row_i_col_j>`` token, closed by its global view
    (``<global-img>``), in prompt order."""
    counts = [n + 1 for n in global_blocks(ids, processor)]
    if len(counts) != num_images:
        raise ValueError(f"the prompt's <row_i_col_j> / <global-img> tokens ({len(counts)} global views) do not "
                         f"match its {num_images} images; is there a literal image token in the text?")
    return counts


class SmolVLMVisionEncoder(torch.nn.Module):
    """SigLIP tower + pixel-shuffle connector of SmolVLM (HF ``SmolVLMVisionTransformer`` and
    ``SmolVLMConnector``); features computed by HF's own ``SmolVLMModel.get_image_features``.

    ``encode_images(tiles)`` returns one ``[image_seq_len, text_hidden]`` tensor per tile.
    """

    get_image_features = SmolVLMModel.get_image_features  # HF's code, bound to this module

    def __init__(self, config: SmolVLMConfig, *, dtype: torch.dtype = torch.float32):
        super().__init__()
        if not isinstance(config, SmolVLMConfig):
            raise TypeError(f"config must be a SmolVLMConfig (the full model config), got {type(config).__name__}")
        self.config = config
        with no_init_weights():  # weights come from a state dict
            self.vision_model = SmolVLMVisionTransformer._from_config(config.vision_config, dtype=dtype)
            self.connector = SmolVLMConnector(config).to(dtype)

    @classmethod
    def from_state_dict(cls, config: SmolVLMConfig, state_dict: dict[str, torch.Tensor], *,
                        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> "SmolVLMVisionEncoder":
        """Load ``vision_model.*`` and ``connector.*`` weights strictly.

        Raises:
            ValueError: missing or unexpected keys (listed), or shapes that do not fit.
        """
        encoder = cls(config, dtype=dtype)
        expected, given = set(encoder.state_dict()), set(state_dict)
        if expected != given:
            raise ValueError(f"SmolVLM vision state dict mismatch: missing keys {sorted(expected - given)[:8]}; "
                             f"unexpected keys {sorted(given - expected)[:8]}")
        try:
            encoder.load_state_dict(state_dict, strict=True)
        except RuntimeError as exc:
            raise ValueError(f"SmolVLM vision state dict does not fit the config: {exc}") from exc
        return encoder.to(device=device, dtype=dtype).eval()

    #: the one constructor every family's tower has (``ModelFamily.vision_tower``): the FULL config
    from_hf_config = from_state_dict

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @torch.no_grad()
    def encode_images(self, tiles: list[SmolVLMTile]) -> list[torch.Tensor]:
        """One ``[image_seq_len, text_hidden]`` tensor per tile, in one batched forward."""
        if not tiles:
            return []
        device = next(self.parameters()).device
        pixel_values = torch.stack([t.pixel_values for t in tiles])[None].to(device)  # [1, n, 3, tile, tile]
        masks = torch.stack([t.pixel_attention_mask for t in tiles])[None].to(device)  # [1, n, tile, tile]
        # transformers 5: pooler_output holds, per batch row, its real tiles' rows flattened
        flat = torch.cat(self.get_image_features(pixel_values, masks).pooler_output)  # [n * image_seq_len, text_hidden]
        return list(flat.reshape(len(tiles), -1, flat.shape[-1]).unbind(0))  # n x [image_seq_len, text_hidden]
