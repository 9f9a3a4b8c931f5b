"""Hugging Face Hub ids (``ORG/NAME``) resolved to a local model folder.

Scope: ``resolve_model_path`` turns what a user passes as ``model`` into a folder or file on
disk. A local path that exists always wins; otherwise an ``ORG/NAME`` id is fetched with
``huggingface_hub.snapshot_download`` (its cache layout ``models--ORG--NAME/snapshots/<rev>``,
``HF_HOME`` / ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``, ``revision``, its tqdm bar), limited to
the files the engine reads (``HUB_ALLOW_PATTERNS``): config, generation config, tokenizer,
processor / chat template, safetensors weights and their index. No other weights format
(``*.bin``, ``*.pth``) is downloaded. A GGUF repo is taken as llama.cpp's ``-hf`` takes it
(``resolve_model``, :mod:`atlas_vlm.hub_gguf`): ``ORG/NAME-GGUF[:QUANT]`` or ``hf_file=``
fetch one ``.gguf`` (all parts of a split one) and the repo's paired ``mmproj``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

HUB_ALLOW_PATTERNS = [
    "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
    "special_tokens_map.json", "added_tokens.json",
    "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
    "chat_template.json", "chat_template.jinja",
    "*.safetensors", "model.safetensors.index.json",
]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")  # huggingface_hub's repo id form: ORG/NAME
_TAGGED = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.\-]*/[\w.\-]+):(?P<tag>[\w.\-]+)$")  # llama.cpp's ORG/NAME:QUANT
_TRUE = {"1", "ON", "YES", "TRUE"}


def looks_like_repo_id(model: str) -> bool:
    """``ORG/NAME`` (or llama.cpp's ``ORG/NAME:QUANT``) with hub-valid characters (no leading
    ``/``, ``.``, ``~``, one slash)."""
    return bool(_REPO_ID.match(model) or _TAGGED.match(model)) and ".." not in model


def split_tag(model: str) -> tuple[str, str | None]:
    """``ORG/NAME:QUANT`` -> (``ORG/NAME``, ``QUANT``); anything else -> (model, None)."""
    m = _TAGGED.match(model)
    return (m["repo"], m["tag"]) if m else (model, None)


def is_gguf_repo_form(model: str, hf_file: str | None = None) -> bool:
    """A Hub id to be taken as a GGUF repo: a ``:QUANT`` tag, an ``hf_file``, or a name ending
    in ``-GGUF`` (case-insensitive), as GGUF repos on the Hub are named."""
    repo, tag = split_tag(model)
    return tag is not None or hf_file is not None or repo.lower().endswith("gguf")


def resolve_model(model: str | os.PathLike, revision: str | None = None, hf_file: str | None = None
                  ) -> tuple[Path, Path | None]:
    """``resolve_model_path`` and, for a GGUF repo, its paired mmproj (``None`` otherwise).

    Args:
        model: a local path, a Hub id ``ORG/NAME`` or ``ORG/NAME:QUANT`` (a GGUF repo's quant tag).
        revision: branch, tag or commit of the Hub repo (``None``: ``main``).
        hf_file: the GGUF repo file to load (llama.cpp's ``--hf-file``); wins over a tag.

    Returns:
        (the model folder or ``.gguf`` (a split file's first part), the mmproj ``.gguf`` or None).

    Raises:
        ModelNotFoundError: as ``resolve_model_path``; for a GGUF repo also: no file of the tag
            (the tags it has are listed), ``hf_file`` not in the repo, not cached when offline
            (the message gives the ``huggingface-cli download ... --include`` line).
    """
    path = Path(model).expanduser()
    if path.exists() or not looks_like_repo_id(str(model)):
        return path, None
    from atlas_vlm.checkpoint import ModelNotFoundError
    from atlas_vlm.hub_gguf import fetch_gguf

    repo_id, tag = split_tag(str(model))
    if is_gguf_repo_form(str(model), hf_file):
        return fetch_gguf(repo_id, tag, hf_file, revision, hub_cache_dir(), hub_offline())
    path = resolve_model_path(model, revision)
    if (path / "config.json").exists() or any(path.glob("*.safetensors")):
        return path, None
    try:  # no config, no safetensors: a GGUF repo named otherwise
        return fetch_gguf(repo_id, None, None, revision, hub_cache_dir(), hub_offline())
    except ModelNotFoundError:
        return path, None  # the loader says what the folder lacks


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` read now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE or bool(constants.HF_HUB_OFFLINE)


def hub_cache_dir() -> str | None:
    """``HF_HUB_CACHE``, else ``HF_HOME/hub``, read now; ``None``: huggingface_hub's default."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


def resolve_model_path(model: str | os.PathLike, revision: str | None = None, *, config_only: bool = False) -> Path:
    """A local model folder / ``.gguf`` for ``model``.

    Args:
        model: a local path (returned as is when it exists) or a Hub id ``ORG/NAME``.
        revision: branch, tag or commit of the Hub repo (``None``: ``main``).
        config_only: fetch ``config.json`` alone (the memory planner needs nothing else).

    Returns:
        the path (for a Hub id, the snapshot folder in the Hub cache).

    Raises:
        ModelNotFoundError: the path does not exist and is no Hub id, or the Hub id is neither
            cached nor downloadable; the message says how to get the model.
    """
    from atlas_vlm.checkpoint import ModelNotFoundError

    path = Path(model).expanduser()
    if path.exists() or not looks_like_repo_id(str(model)):
        return path
    if is_gguf_repo_form(str(model)):
        return resolve_model(model, revision)[0]
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    repo_id, offline = str(model), hub_offline()
    rev = f" (revision {revision})" if revision else ""
    get = f"huggingface-cli download {repo_id}" + (f" --revision {revision}" if revision else "")
    try:
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=["config.json"] if config_only else HUB_ALLOW_PATTERNS,
                                   cache_dir=hub_cache_dir(), local_files_only=offline)
    except LocalEntryNotFoundError as exc:
        how = (f"HF_HUB_OFFLINE is set: unset it to download, or fetch it first with `{get}`" if offline
               else f"check the network, or fetch it first with `{get}`")
        how += f"; for a GGUF repo name its quant, {repo_id}:Q4_K_M, or fetch with `{get} --include \"*Q4_K_M*.gguf\"`"
        raise ModelNotFoundError(
            f"model {repo_id!r}{rev} is not a local path and is not in the Hugging Face cache "
            f"({hub_cache_dir() or 'default HF cache'}); {how}") from exc
    except RepositoryNotFoundError as exc:
        raise ModelNotFoundError(f"model {repo_id!r} is not a local path and the Hub has no such repo "
                                 f"(or it is private/gated: run `huggingface-cli login`)") from exc
    except (HfHubHTTPError, OSError) as exc:
        raise ModelNotFoundError(f"model {repo_id!r}{rev}: download failed ({exc}); fetch it with `{get}`") from exc
    return Path(folder)
