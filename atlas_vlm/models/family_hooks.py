"""``FamilyHooks``: what a model family computes its own way, behind one interface.

A family folder (``atlas_vlm/models/<family>/family.py``) subclasses ``FamilyHooks`` and its
registry line names the subclass (``ModelFamily.hooks``); callers reach it through
``ModelFamily.family_hooks()`` (the registry finds the family from a config), never by
comparing ``model_type`` strings. Text-only families keep this base class: no vision tower
(``vision_params`` 0), no image settings. Every method takes the model's full transformers
config ``hf_config`` (``vision_config`` holds the tower's fields).

The config-size helpers the hooks and ``param_count`` count with (``text_config``,
``head_dim``, ``num_kv_heads``, ``linear_params``) live here too: a family module imports this
base and never the registry (``param_count`` does: ``tests/test_import_graph.py``).
"""

from __future__ import annotations


def text_config(hf_config):
    """The decoder's config (``get_text_config(decoder=True)``: itself for text models)."""
    return hf_config.get_text_config(decoder=True)


def head_dim(text) -> int:
    """``head_dim`` when the config sets it, else ``hidden_size // num_attention_heads``."""
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def num_kv_heads(text) -> int:
    """``num_key_value_heads`` when the config sets it, else ``num_attention_heads``."""
    return getattr(text, "num_key_value_heads", None) or text.num_attention_heads


def linear_params(n_in: int, n_out: int, bias: bool = True) -> int:
    """Parameters of ``nn.Linear(n_in, n_out, bias)``."""
    return n_in * n_out + (n_out if bias else 0)


class FamilyHooks:
    """Per-family rules of the planner (``memory_plan``), the parameter counts
    (``param_count``) and the image-processor settings (``mm_token_pipeline.processor_config``).

    Attributes:
        processor_defaults: what the family's released ``preprocessor_config.json`` files say
            (``min_pixels`` / ``max_pixels`` / ``image_mean`` / ``image_std``), used where a
            folder has none; None: the family states none (``image_processor_settings`` raises).
    """

    processor_defaults: dict | None = None

    def image_processor_settings(self, path, hf_config, label: str):
        """The checkpoint's ``ImageProcessorSettings`` from its ``preprocessor_config.json``
        ``path`` (None: the released defaults, ``source`` naming ``label``).

        Raises:
            ValueError: the family states no defaults, or the file disagrees with the tower.
        """
        from mm_token_pipeline.processor_config import settings_from_processor

        if self.processor_defaults is None:
            raise ValueError(f"no image-processor defaults for model_type {label!r}")
        return settings_from_processor(path, hf_config.vision_config, self.processor_defaults, label)

    def text_params(self, hf_config) -> int | None:
        """Decoder parameters from the config alone, for a decoder ``param_count.text_params``'s
        plain formula does not describe (a hybrid: Qwen3.5); None: that formula applies."""
        return None

    def vision_params(self, hf_config) -> int:
        """Parameters of the vision tower (+ connector) from the config alone; 0: no tower.

        Raises:
            ValueError: a tower this family has no formula for.
        """
        return 0

    def vision_activation_shape(self, hf_config, max_pixels: int) -> tuple[int, int, int]:
        """``(N patches, width d, MLP width I)`` of the tower on one image of ``max_pixels``
        (``memory_plan.vision_activation_peak``'s ``N * (5 d + 2 I)``)."""
        raise ValueError(f"{type(self).__name__} has no vision tower")

    def visual_tokens_per_image(self, hf_config, max_pixels: int) -> int:
        """Most visual tokens one image can take at ``max_pixels``."""
        raise ValueError(f"{type(self).__name__} has no vision tower")

    def largest_image_pixels(self, hf_config, max_tokens: int) -> int:
        """The largest ``max_pixels`` whose image takes at most ``max_tokens`` visual tokens."""
        raise ValueError(f"{type(self).__name__} has no vision tower")

    def video_tokens_per_clip(self, hf_config, seconds: float, video_sampling: dict | None, *, fps, max_frames,
                              nframes) -> tuple[int, int, int]:
        """``(frames, pixels per frame, visual tokens)`` of the largest clip of ``seconds``
        seconds (``memory_plan.video_tokens_per_clip`` documents the arguments)."""
        raise ValueError(f"{type(self).__name__} has no vision tower")
