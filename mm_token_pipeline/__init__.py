"""mm_token_pipeline: images and chat messages to the tokens, embeddings and positions of a prompt.

Scope: the stages every family shares: image loading and normalisation (``load_image``; URLs
through ``fetch_url`` with an overall deadline and a byte cap, under the engine's and the
server's one ``MediaFetchPolicy``), chat messages (their checks, ``extract_mm_items``),
per-request options (``MultiModalOptions``), qwen-vl-utils ``smart_resize`` with
``min_pixels``/``max_pixels``, the processed-image record (``ProcessedImage``, ``content_hash``),
video decoding and frame sampling (``load_video``), M-RoPE positions (``get_rope_index``).
Imports only torch, Pillow, numpy, transformers, qwen-vl-utils, PyAV (``av``, on first video
use) and the standard library; never ``atlas_vlm`` or ``mm_kv_cache_management`` (``tests/test_import_graph.py``).
Each family's own code (its vision tower, prompt rules, media inputs, image processor,
chat template) lives in its folder under ``atlas_vlm/models/`` (see ``atlas_vlm.models.registry``):
for Qwen2-VL / Qwen2.5-VL the tower is ``atlas_vlm.models.qwen2_vl.vision.VisionEncoder``, the
image and video processors ``qwen2_vl.image_processor.preprocess_image`` and
``qwen2_vl.video_processor.preprocess_video`` (HF ``Qwen2VLImageProcessor`` / ``Qwen2VLVideoProcessor``),
the prompt ids ``qwen2_vl.prompt_ids.build_prompt_ids`` (placeholder expansion, the Qwen2.5-VL
default chat template ``QWEN2_5_VL_CHAT_TEMPLATE``).

Data path of one request (shapes for the default geometry: patch 14 px, merge 2)::

    from transformers import AutoTokenizer
    import mm_token_pipeline as mtp
    from atlas_vlm.models.qwen2_vl.image_processor import preprocess_image
    from atlas_vlm.models.qwen2_vl.prompt_ids import build_prompt_ids
    from atlas_vlm.models.qwen2_vl.tokenizer_files import qwen_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    messages = [{"role": "user", "content": [
        {"type": "image", "image": "tests/data/images/chelsea.png"},
        {"type": "text", "text": "Describe this image."}]}]
    images = [mtp.load_image(src) for src in mtp.extract_images(messages)]   # RGB PIL
    processed = [preprocess_image(im) for im in images]                       # ProcessedImage
    ids = build_prompt_ids(tok, messages, processed)                          # [N] token ids
    positions, rope_delta = mtp.get_rope_index(
        ids, [p.grid_thw for p in processed],
        image_token_id=151655, vision_start_token_id=151652)                 # [3, N], int
    encoder = VisionEncoder.from_state_dict(vision_config, visual_state_dict,   # models.qwen2_vl.vision
                                            dtype=torch.float32, device="cpu")
    embeds = encoder.encode(processed)                # [num_tokens_i, out_hidden] each
    next_pos = mtp.decode_position(len(ids), rope_delta)     # position of the first new token

Video: ``load_video`` decodes with PyAV, seeking to the frames qwen-vl-utils 0.0.14 samples
(``sample_frame_indices``), into uint8 RGB ``[T, H, W, 3]`` plus fps / frame-index metadata;
Qwen-VL's ``qwen2_vl.video_processor.preprocess_video`` resizes every frame as qwen-vl-utils
``fetch_video`` (``video_frame_bounds`` / ``video_resized_size``, ``resize_frames``) and
patchifies with HF's video processor into a ``ProcessedVideo`` (``pixel_values``,
``grid_thw``, ``second_per_grid_t``, Qwen3-VL ``timestamps``) that ``VisionEncoder.encode``
takes as it takes images; ``qwen2_vl.prompt_ids.build_prompt_ids`` expands ``<|video_pad|>``
(``extract_mm_items`` lists images and videos in prompt order; ``video_timestamps=True`` for
Qwen3-VL); ``get_rope_index(..., video_token_id, video_grid_thw, second_per_grid_ts,
tokens_per_second)`` gives the positions (Qwen3-VL's:
``atlas_vlm.models.qwen3_vl.mrope.get_rope_index_qwen3_vl``).
Bad input raises ``VideoInputError``.

Other families live in their own folders: ``atlas_vlm.models.qwen3_vl`` (patch 16, DeepStack
tower, chat template) and ``atlas_vlm.models.smolvlm`` (prompt and tiles from the HF
``SmolVLMProcessor``, longest-edge bound, SigLIP tower + connector).

Errors: every bad image input raises ``ImageInputError`` (a ``ValueError``) whose message
names the source and the cause; the caller can refuse that request before allocating any
KV cache block, since the token count of each image (``ProcessedImage.num_tokens``) is
known after the family's image processor and never exceeds ``max_pixels // 28**2``.
"""

from .fetch_policy import DEFAULT_VIDEO_MAX_BYTES, MediaFetchPolicy, MediaRefused
from .http_fetch import DownloadError, fetch_url
from .image_io import (DEFAULT_HTTP_MAX_BYTES, DEFAULT_HTTP_TIMEOUT_S, DEFAULT_MAX_IMAGE_PIXELS, ImageInputError,
                       load_image, to_rgb)
from .mrope import decode_position, get_rope_index
from .options import MultiModalOptions
from .processor import ProcessedImage, content_hash
from .prompt import extract_image_items, extract_images, extract_mm_items
from .processor_config import ImageProcessorSettings
from .resize import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, MAX_ASPECT_RATIO, smart_resize
from .video_io import (VideoFrameBounds, VideoFrames, VideoInputError, VideoProbe, load_video, probe_video,
                       sample_frame_indices, video_frame_bounds, video_resized_size)
from .video_processor import ProcessedVideo, resize_frames, video_content_hash

__all__ = [
    "ImageInputError",
    "load_image",
    "to_rgb",
    "DEFAULT_MAX_IMAGE_PIXELS",
    "DEFAULT_HTTP_TIMEOUT_S",
    "DEFAULT_HTTP_MAX_BYTES",
    "DEFAULT_VIDEO_MAX_BYTES",
    "DownloadError",
    "MediaFetchPolicy",
    "MediaRefused",
    "fetch_url",
    "MultiModalOptions",
    "smart_resize",
    "MAX_ASPECT_RATIO",
    "DEFAULT_MIN_PIXELS",
    "DEFAULT_MAX_PIXELS",
    "ImageProcessorSettings",
    "ProcessedImage",
    "content_hash",
    "extract_images",
    "extract_image_items",
    "extract_mm_items",
    "get_rope_index",
    "decode_position",
    "VideoInputError",
    "VideoProbe",
    "VideoFrames",
    "VideoFrameBounds",
    "load_video",
    "probe_video",
    "sample_frame_indices",
    "video_frame_bounds",
    "video_resized_size",
    "ProcessedVideo",
    "resize_frames",
    "video_content_hash",
]
