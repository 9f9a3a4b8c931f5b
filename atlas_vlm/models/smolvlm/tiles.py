"""SmolVLM2's tile item and the prompt pieces its image and video paths share
(``prompt.py`` and ``video.py`` both import them; neither imports the other at module level).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

import torch

__all__ = ["SmolVLMTile", "global_blocks"]


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
