"""Hugging Face Hub ids (``ORG/NAME``) resolved to a local model folder.

Scope: ``resolve_model_path`` turns what a user passes as ``model`` into a folder or file on
disk. A local path that exists always wins; otherwise an ``ORG/NAME`` id is fetched with
``huggingface_hub.snapshot_download`` (its cache layout ``models--ORG--NAME/snapshots/<rev>``,
``HF_HOME`` / ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``, ``revision``, its tqdm bar), limited to
the files the engine reads (``HUB_ALLOW_PATTERNS``): config, generation config, tokenizer,
processor / chat template, safetensors weights and their index. No other weights format
(``*.bin``, ``*.pth``, ``*.gguf``) is downloaded.
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
_TRUE = {"1", "ON", "YES", "TRUE"}


def looks_like_repo_id(model: str) -> bool:
    """``ORG/NAME`` with hub-valid characters (no leading ``/``, ``.``, ``~``, one slash)."""
    return bool(_REPO_ID.match(model)) and ".." not in model


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
        raise ModelNotFoundError(
            f"model {repo_id!r}{rev} is not a local path and is not in the Hugging Face cache "
            f"({hub_cache_dir() or 'default HF cache'}); {how}") from exc
    except RepositoryNotFoundError as exc:
        raise ModelNotFoundError(f"model {repo_id!r} is not a local path and the Hub has no such repo "
                                 f"(or it is private/gated: run `huggingface-cli login`)") from exc
    except (HfHubHTTPError, OSError) as exc:
        raise ModelNotFoundError(f"model {repo_id!r}{rev}: download failed ({exc}); fetch it with `{get}`") from exc
    return Path(folder)
