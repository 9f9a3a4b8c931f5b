"""Tokenizer settings: what a GGUF file states, applied to the HF tokenizer converted from
it, and the one place the engine's end-of-sequence ids come from.

transformers' GGUF conversion (4.57) keeps the vocabulary and merges but not the special-
token settings: SmolLM2-135M-Instruct's GGUF says ``tokenizer.ggml.add_bos_token = false``
and EOS id 2 (``<|im_end|>``), yet the converted tokenizer prepends ``<|im_start|>`` (id 1)
to every prompt and names it as EOS. ``gguf_tokenizer_settings`` reads the header with the
``gguf`` package and resolves each setting the way llama.cpp does
(``src/llama-vocab.cpp``, ``llama_vocab::impl::load``); ``apply_gguf_tokenizer_settings``
writes them onto the tokenizer before it is saved.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["GGUFTokenizerSettings", "gguf_tokenizer_settings", "apply_gguf_tokenizer_settings", "eos_token_ids"]

#: llama.cpp BPE pre-tokenizer types that turn ``clean_spaces`` off (``tokenizer.ggml.pre``).
_NO_CLEAN_SPACES_PRE = {
    "deepseek-llm", "deepseek-coder", "deepseek-v3", "command-r", "qwen2", "deepseek-r1-qwen", "kormo",
    "poro-chat", "viking", "tekken", "smollm", "chameleon", "gpt-4o", "llama4", "superbpe", "trillion",
    "granite-docling", "bailingmoe", "bailingmoe2", "llada-moe", "seed-coder", "hunyuan", "hunyuan-dense",
    "kimi-k2", "grok-2", "afmoe", "minimax-m2",
}
#: llama.cpp BPE pre-tokenizer types that turn ``add_bos`` on by default.
_ADD_BOS_PRE = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                "tekken", "chameleon"}


@dataclass(frozen=True)
class GGUFTokenizerSettings:
    """Tokenizer settings of a GGUF file, resolved with llama.cpp's defaults.

    Token ids index ``tokenizer.ggml.tokens``; ``None`` where the file states none.
    """

    model: str  # tokenizer.ggml.model: "gpt2" (BPE), "llama" (SentencePiece), ...
    pre: str | None  # tokenizer.ggml.pre (BPE pre-tokenizer type)
    tokens: dict[str, str]  # "bos" | "eos" | "eot" | "unk" | "pad" -> token text
    token_ids: dict[str, int]  # same keys -> id
    add_bos_token: bool
    add_eos_token: bool
    clean_up_tokenization_spaces: bool
    chat_template: str | None


def _value(field):
    return field.contents() if field is not None else None


_SETTINGS: dict[tuple, GGUFTokenizerSettings] = {}  # (path, size, mtime) -> settings: a load reads them once


def gguf_tokenizer_settings(path: str | Path, fields=None) -> GGUFTokenizerSettings:
    """Read and resolve the tokenizer settings of the GGUF file at ``path`` (``fields``: its
    header already read, ``checkpoint.read_gguf(path).fields``); kept per file (path, size,
    modification time), so the engine's EOS ids do not read the header again.

    Defaults (llama.cpp): BPE (``gpt2``) models add no BOS unless the pre-tokenizer is a
    Llama-3-like one, clean spaces unless the pre-tokenizer turns it off; SentencePiece
    (``llama``) models add BOS, no EOS, and do not clean spaces. ``tokenizer.ggml.add_bos_token``
    / ``add_eos_token`` in the file override the defaults.

    Raises:
        ValueError: the file has no tokenizer vocabulary, or a special-token id is out of range.
    """
    from atlas_vlm.checkpoint import read_gguf

    stat = Path(path).stat()
    key = (str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)
    if key in _SETTINGS:
        return _SETTINGS[key]
    fields = read_gguf(path).fields if fields is None else fields
    if "tokenizer.ggml.tokens" not in fields:
        raise ValueError(f"{path}: GGUF file has no tokenizer.ggml.tokens")
    vocab = fields["tokenizer.ggml.tokens"].contents()
    model = _value(fields.get("tokenizer.ggml.model")) or "llama"
    pre = _value(fields.get("tokenizer.ggml.pre"))
    if model == "llama":
        add_bos, add_eos, clean = True, False, False
    else:
        add_bos, add_eos, clean = pre in _ADD_BOS_PRE, False, pre not in _NO_CLEAN_SPACES_PRE
    stated_bos = _value(fields.get("tokenizer.ggml.add_bos_token"))
    stated_eos = _value(fields.get("tokenizer.ggml.add_eos_token"))
    ids = {}
    for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("eot", "eot_token_id"),
                      ("unk", "unknown_token_id"), ("pad", "padding_token_id")):
        value = _value(fields.get(f"tokenizer.ggml.{key}"))
        if value is None:
            continue
        if not 0 <= int(value) < len(vocab):
            raise ValueError(f"{path}: tokenizer.ggml.{key}={value} is outside the vocabulary of {len(vocab)}")
        ids[name] = int(value)
    _SETTINGS[key] = GGUFTokenizerSettings(
        model=model, pre=pre, tokens={k: vocab[i] for k, i in ids.items()}, token_ids=ids,
        add_bos_token=add_bos if stated_bos is None else bool(stated_bos),
        add_eos_token=add_eos if stated_eos is None else bool(stated_eos),
        clean_up_tokenization_spaces=clean, chat_template=_value(fields.get("tokenizer.chat_template")),
    )
    return _SETTINGS[key]


def apply_gguf_tokenizer_settings(tokenizer, settings: GGUFTokenizerSettings):
    """Set BOS/EOS/UNK/PAD tokens, ``add_bos_token`` / ``add_eos_token`` (the fast tokenizer's
    post-processor follows), ``clean_up_tokenization_spaces`` and the chat template of
    ``tokenizer`` (in place) as ``settings`` state them. Returns ``tokenizer``.

    Raises:
        ValueError: the tokenizer class does not follow ``add_bos_token`` / ``add_eos_token``
            (checked by encoding ``"a"``), rather than a silently different prompt.
    """
    for name in ("bos", "eos", "unk", "pad"):
        if name in settings.tokens:
            setattr(tokenizer, f"{name}_token", settings.tokens[name])
    tokenizer.add_bos_token = settings.add_bos_token  # LlamaTokenizerFast updates its post-processor
    tokenizer.add_eos_token = settings.add_eos_token
    tokenizer.clean_up_tokenization_spaces = settings.clean_up_tokenization_spaces
    if settings.chat_template is not None:
        tokenizer.chat_template = settings.chat_template
    ids = tokenizer("a")["input_ids"]  # check the setting took: some tokenizer classes ignore it
    for name, wanted, at in (("bos", settings.add_bos_token, 0), ("eos", settings.add_eos_token, -1)):
        if name in settings.token_ids and (ids[at] == settings.token_ids[name]) != wanted:
            raise ValueError(f"{type(tokenizer).__name__} does not follow the GGUF's add_{name}_token={wanted}")
    return tokenizer


def save_gguf_tokenizer(tokenizer, settings: GGUFTokenizerSettings, folder: Path) -> None:
    """``tokenizer.save_pretrained(folder)``, then the GGUF header's ``add_bos_token`` /
    ``add_eos_token`` / ``clean_up_tokenization_spaces`` written into its
    ``tokenizer_config.json``: transformers 5 leaves them out, and the folder must say what it
    does whatever a later version defaults to."""
    import json

    tokenizer.save_pretrained(folder)
    path = Path(folder) / "tokenizer_config.json"
    values = json.loads(path.read_text())
    values.update(add_bos_token=settings.add_bos_token, add_eos_token=settings.add_eos_token,
                  clean_up_tokenization_spaces=settings.clean_up_tokenization_spaces)
    path.write_text(json.dumps(values, indent=2, ensure_ascii=False) + "\n")


def eos_token_ids(tokenizer, model_dir: str | Path) -> set[int]:
    """The ids that end generation: ``tokenizer.eos_token_id`` plus the model folder's
    ``generation_config.json`` ``eos_token_id`` (an int or a list), as HF ``generate`` uses;
    for a ``.gguf`` loaded as stored (``model_dir`` the file) the header's EOS and EOT ids.
    The one source of the engine's EOS set."""
    from transformers import GenerationConfig

    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    if Path(model_dir).suffix == ".gguf" and Path(model_dir).is_file():
        stated = gguf_tokenizer_settings(model_dir).token_ids
        return ids | {stated[k] for k in ("eos", "eot") if k in stated}
    try:
        gen = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        gen = None
    ids |= set(gen if isinstance(gen, list) else [gen] if gen is not None else [])
    return ids
