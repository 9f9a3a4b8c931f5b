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

#: GGUF architectures whose transformers model type differs (transformers' own GGUF loader
#: renames these the same way: a text-only Gemma 3 file is ``gemma3_text``)
GGUF_MODEL_TYPES = {"gemma3": "gemma3_text"}


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
    config["model_type"] = GGUF_MODEL_TYPES.get(config.get("model_type"), config.get("model_type"))
    return AutoConfig.for_model(**config)


def _tokenizer_metadata(reader) -> dict:
    """The header's ``tokenizer.*`` keys and ``general.architecture`` in the form transformers'
    ``read_gguf_metadata(path, ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))`` gives them
    (those two string arrays as lists, any other string array as its count, numeric arrays as
    lists), taken from our already parsed reader instead of a second walk over the header."""
    from gguf.constants import GGUFValueType

    out = {}
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer.") and key != "general.architecture":
            continue
        if field.types[0] == GGUFValueType.ARRAY and field.types[-1] == GGUFValueType.STRING and \
                key not in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            out[key] = len(field.data)
        elif field.types[0] == GGUFValueType.ARRAY:
            out[key] = field.contents()
        else:
            out[key] = field.contents()
    return out


# transformers.integrations.gguf.gguf_tokenizer_mapping._SPECIAL_TOKENS (a private name there)
_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                   "pad_token": "padding_token_id"}


def gguf_tokenizer(reader, config, settings):
    """The tokenizer of the GGUF whose header ``reader`` holds (``config``: its
    :func:`gguf_config`): transformers' GGUF tokenizer conversion (``get_gguf_tokenizer``'s
    steps on the parsed header, then ``convert_gguf_tokenizer``) in the model type's tokenizer
    class, then the header's special tokens, BOS / EOS flags, clean-up and chat template
    (``settings``: ``tokenizer.gguf_tokenizer_settings``).

    Raises:
        ValueError: the model type has no tokenizer class in transformers.
    """
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    from atlas_vlm.tokenizer import apply_gguf_tokenizer_settings

    metadata = _tokenizer_metadata(reader)
    grouped = {group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items()
                       if f"tokenizer.{key}" in metadata}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer_dict, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":  # as get_gguf_tokenizer: llama.cpp adds BOS there
        tokenizer_config.setdefault("add_bos_token", True)
    elif tokenizer_dict.get("tokenizer_type") == "gemma4":
        tokenizer_config["add_bos_token"] = False
    for name, key in _SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
    fast, extra = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
    cls = TOKENIZER_MAPPING.get(type(config), None)
    cls = next((c for c in reversed(cls) if c is not None), None) if isinstance(cls, tuple) else cls
    tokenizer = (cls or PreTrainedTokenizerFast)(tokenizer_object=fast, **tokenizer_config, **extra)
    return apply_gguf_tokenizer_settings(tokenizer, settings)
