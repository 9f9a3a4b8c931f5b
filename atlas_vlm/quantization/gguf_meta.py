"""A GGUF header's transformers config and tokenizer, built in memory (nothing written to the
cache): the config from the header's fields through transformers' own key tables
(``GGUF_TO_TRANSFORMERS_MAPPING``, as its ``load_gguf_checkpoint`` reads them, but from our
already parsed reader: transformers' reader re-parses the whole header, 13 s on a 151,936-token
vocabulary here), the tokenizer through the model type's tokenizer class with ``gguf_file``
(transformers' GGUF tokenizer conversion), then the header's special-token settings
(:mod:`atlas_vlm.tokenizer`).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["gguf_config", "gguf_tokenizer"]

_BIG_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
               "tokenizer.ggml.scores")


def _value(field):
    """A field's value as transformers' ``load_gguf_checkpoint`` gives it: arrays of one unwrapped."""
    value = field.contents()
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def gguf_config(reader, path: Path):
    """The transformers config of a GGUF whose header ``reader`` (``checkpoint.read_gguf``) holds.

    Architectures transformers rebuilds from its fast metadata reader (``GGUF_CONFIG_ARCHS``:
    Qwen3.5, LFM2) go through it; the rest through the key tables ``load_gguf_checkpoint``
    uses (llama / qwen2 / qwen3 / ...), with its renames, defaults and ``tie_word_embeddings``
    (no ``output.weight``) and ``vocab_size`` from the token list where the header lacks it.

    Raises:
        ValueError: an architecture transformers' GGUF support does not know (named).
    """
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING
    from transformers.integrations.gguf import GGUF_CONFIG_ARCHS, get_gguf_config, read_gguf_metadata
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, GGUF_TO_TRANSFORMERS_MAPPING

    fields = reader.fields
    arch = _value(fields["general.architecture"])
    if arch in GGUF_CONFIG_ARCHS:
        metadata, names = read_gguf_metadata(str(path))
        return AutoConfig.for_model(**get_gguf_config(metadata, names))
    name = _value(fields["general.name"]) if "general.name" in fields else ""
    updated = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}.get(arch, arch)
    if "llama" in arch and "mistral" in str(name).lower():
        updated = "mistral"
    if arch not in GGUF_SUPPORTED_ARCHITECTURES and updated not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF {path}: architecture {arch!r} is not one transformers' GGUF support reads")
    config = {"tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors) or arch in ("falcon", "bloom")}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(updated, GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {}).items():
        config.setdefault(key, value)
    renames = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    for key, field in fields.items():
        if key in _BIG_ARRAYS:
            continue
        prefix, _, sub = key.replace(arch, updated).partition(".")
        target = renames.get(prefix, {}).get(sub)
        if target is None or target == -1:
            continue
        value = _value(field)
        config[target] = value.replace(arch, updated) if isinstance(value, str) and arch in value else value
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in fields:
        config["vocab_size"] = len(fields["tokenizer.ggml.tokens"].data)
    if config.get("model_type") == "gemma3":
        config["model_type"] = "gemma3_text"
    return AutoConfig.for_model(**config)


def gguf_tokenizer(path: Path, config, settings):
    """The tokenizer of GGUF ``path`` (``config``: its :func:`gguf_config`), with the header's
    special tokens, BOS / EOS flags, clean-up and chat template applied (``settings``:
    ``tokenizer.gguf_tokenizer_settings``)."""
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    from atlas_vlm.tokenizer import apply_gguf_tokenizer_settings

    path = Path(path)
    cls = TOKENIZER_MAPPING.get(type(config), None)
    cls = next((c for c in reversed(cls) if c is not None), None) if isinstance(cls, tuple) else cls
    if cls is None:  # no class for the model type: transformers picks (reading the config itself)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    else:
        tokenizer = cls.from_pretrained(path.parent, gguf_file=path.name)
    return apply_gguf_tokenizer_settings(tokenizer, settings)
