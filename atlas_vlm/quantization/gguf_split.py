"""Split GGUF files (``name-00001-of-00003.gguf``, llama.cpp's ``gguf-split``) read as one model.

Scope: ``gguf-py``'s ``GGUFReader`` and transformers' GGUF loading both read one file, so the
parts are merged once into one GGUF in the checkpoint cache (``llama-gguf-split --merge``'s
result: the first part's header without the ``split.*`` keys, every part's tensors in order,
each as stored, no re-quantization), keyed by every part's path, size and modification time.
Every GGUF reader of the project then takes the merged file.
"""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

from atlas_vlm.checkpoint import ModelNotFoundError, cache_dir

SPLIT = re.compile(r"^(?P<base>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
GGUF_SPLIT_VERSION = "v1"  # part of the merged file's cache key


def split_parts(path: Path) -> list[Path] | None:
    """Every part of the split GGUF ``path`` is a part of (in order), or None for a plain file.

    Raises:
        ModelNotFoundError: a part is missing (named).
    """
    m = SPLIT.match(path.name)
    if not m:
        return None
    count = int(m["count"])
    parts = [path.with_name(f"{m['base']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise ModelNotFoundError(f"split GGUF {path.name} has {count} parts; missing: {', '.join(missing)}")
    return parts


def merged_gguf(path: Path) -> Path:
    """``path`` itself, or for a part of a split GGUF the one merged file (built once).

    Returns:
        a ``.gguf`` holding all the parts' tensors and the first part's header (minus
        ``split.*``), in ``cache_dir()/gguf-merged``.

    Raises:
        ModelNotFoundError: a part is missing.
        ValueError: the parts disagree with their ``split.count`` / ``split.tensors.count``.
    """
    parts = split_parts(path)
    if parts is None:
        return path
    ident = GGUF_SPLIT_VERSION + "".join(f":{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in parts)
    key = hashlib.sha256(ident.encode()).hexdigest()[:12]
    base = SPLIT.match(path.name)["base"]
    out = cache_dir() / "gguf-merged" / f"{base}-{key}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"Merging {len(parts)} split GGUF parts of {base} into {out} (once)...", file=sys.stderr, flush=True)
    tmp = out.with_name(out.name + f".tmp-{hashlib.sha256(str(id(parts)).encode()).hexdigest()[:6]}")
    try:
        _write_merged(parts, tmp)
        tmp.replace(out)  # atomic: a half-written merge is never taken
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _write_merged(parts: list[Path], out: Path) -> None:
    """Write the parts' header (first part's, ``split.*`` dropped) and tensors to ``out``."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    readers = [GGUFReader(str(p)) for p in parts]
    first = readers[0]
    arch = first.fields["general.architecture"].contents()
    want = first.fields["split.tensors.count"].contents() if "split.tensors.count" in first.fields else None
    have = sum(len(r.tensors) for r in readers)
    if want is not None and want != have:
        raise ValueError(f"split GGUF {parts[0].name}: header says {want} tensors, the {len(parts)} parts hold {have}")
    w = GGUFWriter(str(out), arch)
    for key, field in first.fields.items():
        if key.startswith(("GGUF.", "split.")) or key == "general.architecture":
            continue  # the writer's own header fields, and the split bookkeeping
        sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for reader in readers:
        for t in reader.tensors:
            # t.data: the stored bytes as uint8 rows [rows, bytes a row] (quantized) or the values
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
