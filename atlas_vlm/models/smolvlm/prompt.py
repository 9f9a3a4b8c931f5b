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

from mm_token_pipeline.image_io import ImageInputError

from .tiles import SmolVLMTile, _as_template_messages, global_blocks

__all__ = ["SmolVLMTile", "longest_edge_for", "smolvlm_prompt"]


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
        from .video import smolvlm_video_prompt

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


def _tiles_per_image(ids: list[int], processor, num_images: int) -> list[int]:
    """Tiles of each image: one per ``<row_i_col_j>`` token, closed by its global view
    (``<global-img>``), in prompt order."""
    counts = [n + 1 for n in global_blocks(ids, processor)]
    if len(counts) != num_images:
        raise ValueError(f"the prompt's <row_i_col_j> / <global-img> tokens ({len(counts)} global views) do not "
                         f"match its {num_images} images; is there a literal image token in the text?")
    return counts
