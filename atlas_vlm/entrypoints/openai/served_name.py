"""The name a server gives its model (``--served-model-name``'s default) and which names a
request may send for it.

Naming (issue 35, item 8): a model served from a local file is named by its stem, lower-cased
(``/x/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf`` -> ``qwen2.5-coder-1.5b-instruct-q4_k_m``); from
a folder by the folder's name, lower-cased; a Hub id (``ORG/NAME``, not a local path) is kept
as given, as vLLM does; no model at all is the embedded ``SmolLM2-135M-Instruct``. The path
itself never appears in a response or on the chat page. A request that names the model by
the path it was started with is still accepted (lenient), and answered with the served name.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_TEXT_NAME = "SmolLM2-135M-Instruct"  # the embedded default (default_models.default_text_model)


def default_served_model_name(model: str | os.PathLike | None) -> str:
    """The served name of ``model`` (the ``MODEL`` argument of ``atlas-vlm serve``).

    Args:
        model: a local ``.gguf`` file, an HF folder, a Hub id ``ORG/NAME``, or None (the
            embedded default model).

    Returns:
        a file's lower-cased stem, a folder's lower-cased name, a Hub id unchanged, or
        ``DEFAULT_TEXT_NAME``.
    """
    if model is None:
        return DEFAULT_TEXT_NAME
    path = Path(model).expanduser()
    if path.is_file():
        return path.stem.lower()
    if path.is_dir():
        return path.resolve().name.lower()
    return str(model)  # a Hub id (resolved later) or a path that the loader will report missing


def same_model_path(name: str, model_root: str | None) -> bool:
    """Whether a request's ``model`` value ``name`` is the path (or id) the server was started
    with, as given or as the same file / folder (``~`` expanded, relative to the working
    directory)."""
    if not model_root or not name:
        return False
    if name == model_root:
        return True
    try:
        a, b = Path(name).expanduser(), Path(model_root).expanduser()
        return a.exists() and b.exists() and a.resolve() == b.resolve()
    except (OSError, ValueError):  # a name no file system takes (a NUL byte, too long)
        return False
