"""GGUF repos on the Hugging Face Hub, taken as llama.cpp's ``-hf`` / ``--hf-file`` take them.

Scope: which files of a GGUF repo make the model (``select_gguf``, on a repo listing: the
quant tag of ``ORG/NAME-GGUF:Q4_K_M`` matched case-insensitively against the file names; no
tag: ``Q4_K_M``, else the first ``.gguf``; or one file named by ``hf_file``), all parts of a
split file (``name-00001-of-00003.gguf``), and the repo's ``mmproj-*.gguf`` paired with it;
then ``fetch_gguf`` downloads them through huggingface_hub's cache (or, offline / without
network, serves them from it). ``atlas_vlm.hub.resolve_model`` calls it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath

from atlas_vlm.quantization.gguf_split import SPLIT

DEFAULT_TAG = "Q4_K_M"  # llama.cpp's (and the Hub's GGUF manifest's) default quant
# a quant tag inside a file name: Q4_K_M, IQ4_XS, Q8_0, UD-Q4_K_XL, F16, BF16, F32, MXFP4 ...
_TAG = re.compile(r"(?<![A-Za-z0-9])((?:UD-)?(?:I?Q\d+(?:_[A-Z0-9]+)*|BF16|F16|F32|FP16|FP32|MXFP4(?:_MOE)?|TQ\d_\d))"
                  r"(?![A-Za-z0-9])", re.IGNORECASE)


@dataclass
class GGUFChoice:
    """The repo files one model needs: ``parts`` (one file, or every part of a split file in
    order) and ``mmproj`` (the paired vision tower, or ``None``)."""

    parts: list[str]
    mmproj: str | None = None

    @property
    def files(self) -> list[str]:
        return self.parts + ([self.mmproj] if self.mmproj else [])


def is_mmproj(name: str) -> bool:
    """A vision-tower GGUF (llama.cpp names them ``mmproj-*.gguf`` / ``*-mmproj-*.gguf``)."""
    return "mmproj" in PurePosixPath(name).name.lower()


def quant_tag(name: str) -> str | None:
    """The quant tag of a GGUF file name, upper case (``qwen2-q4_k_m.gguf`` -> ``Q4_K_M``), or None."""
    stem = PurePosixPath(name).name
    split = SPLIT.match(stem)
    stem = split["base"] if split else stem[:-len(".gguf")] if stem.lower().endswith(".gguf") else stem
    found = _TAG.findall(stem)
    return found[-1].upper() if found else None


def _tag_matches(name: str, tag: str) -> bool:
    base = PurePosixPath(name).name
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(tag)}(?![A-Za-z0-9_])", base, re.IGNORECASE) is not None


def _parts_of(name: str, files: list[str]) -> list[str]:
    """``name`` alone, or every part of the split file ``name`` belongs to, in order.

    Raises:
        ValueError: a part of the split file is missing from ``files``.
    """
    split = SPLIT.match(PurePosixPath(name).name)
    if not split:
        return [name]
    folder, count = PurePosixPath(name).parent, int(split["count"])
    want = [str(folder / f"{split['base']}-{i:05d}-of-{count:05d}.gguf").removeprefix("./") for i in range(1, count + 1)]
    missing = [w for w in want if w not in files]
    if missing:
        raise ValueError(f"split GGUF {name} has {count} parts; missing from the repo: {', '.join(missing)}")
    return want


def _pick_mmproj(mmprojs: list[str], tag: str | None) -> str | None:
    """The repo's mmproj: one of the model's quant tag, else F16, BF16, F32, else the first."""
    for want in ([tag] if tag else []) + ["F16", "BF16", "F32"]:
        hit = [m for m in mmprojs if quant_tag(m) == want.upper()]
        if hit:
            return hit[0]
    return mmprojs[0] if mmprojs else None


def select_gguf(files: list[str], tag: str | None = None, hf_file: str | None = None, repo_id: str = "repo") -> GGUFChoice:
    """The model GGUF (all its split parts) and paired mmproj among a repo's ``files``.

    Args:
        files: the repo listing (paths inside the repo).
        tag: a quant tag (``Q4_K_M``, ``q8_0``, ``IQ4_XS``: case-insensitive); ``None``: ``Q4_K_M``
            when the repo has it, else the first model ``.gguf`` (sorted), as llama.cpp.
        hf_file: one file named outright (llama.cpp's ``--hf-file``); wins over ``tag``.
        repo_id: named in the errors.

    Raises:
        ValueError: no model ``.gguf`` in ``files``; ``hf_file`` not in the repo; no file of
            ``tag`` (the message lists the tags the repo has); a split file's part missing.
    """
    files = sorted(files)
    models = [f for f in files if f.lower().endswith(".gguf") and not is_mmproj(f)]
    mmprojs = [f for f in files if f.lower().endswith(".gguf") and is_mmproj(f)]
    if hf_file is not None:
        if hf_file not in files:
            raise ValueError(f"hf_file {hf_file!r} is not in {repo_id}; its .gguf files: {', '.join(models) or 'none'}")
        chosen = hf_file
    else:
        if not models:
            raise ValueError(f"{repo_id} has no model .gguf file")
        if tag is not None:
            hits = [f for f in models if _tag_matches(f, tag)]
            if not hits:
                tags = sorted({t for t in map(quant_tag, models) if t})
                raise ValueError(f"{repo_id} has no .gguf of quant tag {tag!r}; its tags: {', '.join(tags) or 'none'}")
        else:
            hits = [f for f in models if _tag_matches(f, DEFAULT_TAG)] or models
        chosen = hits[0]
    if is_mmproj(chosen):
        return GGUFChoice(_parts_of(chosen, files))
    return GGUFChoice(_parts_of(chosen, files), _pick_mmproj(mmprojs, quant_tag(chosen)))


def get_hint(repo_id: str, choice_tag: str | None, hf_file: str | None, revision: str | None) -> str:
    """The ``huggingface-cli download`` line that puts a GGUF repo's model in the cache."""
    include = hf_file or f"*{choice_tag or DEFAULT_TAG}*.gguf"
    rev = f" --revision {revision}" if revision else ""
    return f"huggingface-cli download {repo_id}{rev} --include \"{include}\" \"*mmproj*\""


def fetch_gguf(repo_id: str, tag: str | None, hf_file: str | None, revision: str | None,
               cache_dir: str | None, offline: bool):
    """Download (or, offline / without network, find in the cache) a GGUF repo's model.

    Returns:
        ``(model_path, mmproj_path | None)``: local paths in the Hub cache's snapshot folder;
        ``model_path`` is the first part of a split file.

    Raises:
        ModelNotFoundError: not cached when offline / unreachable (the message gives the
            ``huggingface-cli download ... --include`` line), no such repo, or no file fits.
    """
    from pathlib import Path

    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    from atlas_vlm.checkpoint import ModelNotFoundError

    hint = get_hint(repo_id, tag, hf_file, revision)
    where = f"the Hugging Face cache ({cache_dir or 'default HF cache'})"
    files = None
    if not offline:
        try:
            files = HfApi().list_repo_files(repo_id, revision=revision)
        except RepositoryNotFoundError as exc:
            raise ModelNotFoundError(f"model {repo_id!r}: the Hub has no such repo (or it is private/gated: "
                                     f"run `huggingface-cli login`)") from exc
        except (HfHubHTTPError, OSError):
            files = None  # unreachable: the cache serves, as huggingface_hub's own downloads do
    local = files is None
    if local:
        try:  # the cached snapshot folder; allow_patterns=[]: asks for no file, so a partial one is fine
            folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=[], cache_dir=cache_dir,
                                            local_files_only=True))
        except LocalEntryNotFoundError as exc:
            how = "HF_HUB_OFFLINE is set: unset it to download, or" if offline else "the Hub is unreachable: check the network, or"
            raise ModelNotFoundError(f"GGUF model {repo_id!r} is not in {where}; {how} fetch it first with `{hint}`") from exc
        files = [str(p.relative_to(folder)) for p in folder.rglob("*.gguf")]
    try:
        choice = select_gguf(files, tag, hf_file, repo_id)
    except ValueError as exc:
        extra = f" (cached files only: the Hub was not asked; fetch it with `{hint}`)" if local else ""
        raise ModelNotFoundError(f"{exc}{extra}") from exc
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=choice.files, cache_dir=cache_dir,
                                        local_files_only=local))
    except (HfHubHTTPError, OSError) as exc:
        raise ModelNotFoundError(f"model {repo_id!r}: download of {', '.join(choice.files)} failed ({exc}); "
                                 f"fetch it with `{hint}`") from exc
    return folder / choice.parts[0], (folder / choice.mmproj if choice.mmproj else None)
