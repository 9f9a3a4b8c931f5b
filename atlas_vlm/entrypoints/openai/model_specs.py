"""Which models a several-model server serves (issue 36, item 1): ``--model [NAME=]PATH``
(repeatable) and ``--models-dir DIR``, as ``ModelSpec``s named like the single-model server
names its model (``served_name.default_served_model_name``).

In ``--models-dir`` (llama-server's router layout): each ``.gguf`` file other than an
``mmproj-*.gguf`` is a model named by its stem, paired with ``mmproj-<stem>.gguf`` when that
file exists; each sub-folder is a model named by the folder: an HF folder (``config.json``)
as is, or a GGUF pair (one model ``.gguf`` + one ``mmproj-*.gguf``) or a lone ``.gguf``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: why ``--replicas`` (Ray Serve) is refused with several models
SEVERAL_MODELS_WITH_REPLICAS = (
    "--replicas N serves N copies of ONE model: each Ray Serve replica owns one engine built at deploy time "
    "and the ingress picks a replica by prefix cache and load, not by the request's `model`, so a model "
    "loaded on demand in one replica would be missing in the others. Serve several models from one process "
    "(drop --replicas: the router loads and unloads them by name), or run one `atlas-vlm serve MODEL "
    "--replicas N` per model behind your proxy")


def refuse_replicas(num_models: int, replicas: int | None) -> None:
    """Raise when the several-model server (several ``--model`` or a ``--models-dir``, of
    ``num_models`` models) is asked for Ray Serve replicas (``replicas > 1``).

    Raises:
        ValueError: ``SEVERAL_MODELS_WITH_REPLICAS`` (it says why and what to do instead).
    """
    if replicas is not None and replicas > 1:
        raise ValueError(f"{num_models} models with --replicas {replicas}: {SEVERAL_MODELS_WITH_REPLICAS}")


@dataclass(frozen=True)
class ModelSpec:
    """One servable model: its served ``name``, the ``model`` path (HF folder or ``.gguf``)
    and, for a GGUF VLM, its ``mmproj`` file."""

    name: str
    model: str
    mmproj: str | None = None


def _is_mmproj(path: Path) -> bool:
    return path.name.lower().startswith("mmproj")


def _folder_spec(folder: Path) -> ModelSpec | None:
    name = folder.name.lower()
    if (folder / "config.json").is_file():
        return ModelSpec(name, str(folder))
    ggufs = sorted(p for p in folder.glob("*.gguf") if p.is_file())
    models = [p for p in ggufs if not _is_mmproj(p)]
    projs = [p for p in ggufs if _is_mmproj(p)]
    if len(models) != 1 or len(projs) > 1:
        return None  # not a model folder (or an ambiguous one): skipped
    return ModelSpec(name, str(models[0]), str(projs[0]) if projs else None)


def discover_models(models_dir: str) -> list[ModelSpec]:
    """The models of ``models_dir`` (see the module docstring), sorted by name.

    Raises:
        ValueError: ``models_dir`` is not a folder.
    """
    from atlas_vlm.entrypoints.openai.served_name import default_served_model_name

    root = Path(models_dir).expanduser()
    if not root.is_dir():
        raise ValueError(f"--models-dir {models_dir!r} is not a folder")
    specs = []
    for entry in sorted(root.iterdir()):
        if entry.is_dir():
            spec = _folder_spec(entry)
            if spec is not None:
                specs.append(spec)
        elif entry.suffix.lower() == ".gguf" and not _is_mmproj(entry):
            proj = entry.with_name(f"mmproj-{entry.name}")
            specs.append(ModelSpec(default_served_model_name(entry), str(entry),
                                   str(proj) if proj.is_file() else None))
    return sorted(specs, key=lambda s: s.name)


def model_specs(models: list[str] | None, models_dir: str | None) -> list[ModelSpec]:
    """The ``ModelSpec``s of ``--model`` values (``PATH`` or ``NAME=PATH``; a path holding
    ``=`` is taken whole when it exists) followed by those of ``--models-dir``.

    Raises:
        ValueError: an empty name or path, or two models with one name (both named).
    """
    from atlas_vlm.entrypoints.openai.served_name import default_served_model_name

    specs = []
    for value in models or []:
        name, sep, path = value.partition("=")
        if not sep or Path(value).expanduser().exists():
            name, path = default_served_model_name(value), value
        if not name or not path:
            raise ValueError(f"--model {value!r}: expected PATH or NAME=PATH")
        specs.append(ModelSpec(name, path))
    if models_dir:
        specs.extend(discover_models(models_dir))
    seen: dict[str, str] = {}
    for s in specs:
        if s.name in seen:
            raise ValueError(f"two models are named {s.name!r} ({seen[s.name]} and {s.model}); "
                             "give one an alias with --model NAME=PATH")
        seen[s.name] = s.model
    return specs
