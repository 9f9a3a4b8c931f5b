"""Where a batch's result records go (one JSONL output file, and optionally a separate error
file), resumable: records already there say which input lines are done, so a rerun after a
crash or Ctrl-C appends only the others. Each record is one ``write`` of a whole line, flushed,
so only the last line can be cut by a crash; it is detected and dropped (its line is redone)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from atlas_vlm.entrypoints.openai.batch.lines import record_ok

logger = logging.getLogger(__name__)


class ResultFiles:
    """Append-only result files.

    Args:
        out_path: the output file (successes; also failures when ``err_path`` is None).
        err_path: the error file for failed lines, or None.

    Attributes:
        done_ids: ``custom_id``s with a record already (their lines are skipped).
        done_lines: line numbers with a record keyed by line (see ``lines.error_record``).
        completed, failed: successes and failures recorded, earlier runs included.

    Raises:
        ValueError: an existing file holds a line that is not a result record before its last
            line (not a file this writes: refused rather than truncated).
        OSError: a file cannot be read or written.
    """

    def __init__(self, out_path: str | os.PathLike, err_path: str | os.PathLike | None = None):
        self.done_ids: set[str] = set()
        self.done_lines: set[int] = set()
        self.completed = self.failed = 0
        same = err_path is None or Path(err_path).resolve() == Path(out_path).resolve()
        self._out = self._open(Path(out_path))
        self._err = self._out if same else self._open(Path(err_path))

    def _open(self, path: Path):
        """Read ``path``'s records, cut a half-written last line, open it for appending."""
        keep = 0
        if path.exists():
            with open(path, "rb") as f:
                bad = None
                for n, raw in enumerate(f, 1):
                    if bad is not None:  # only the last line may be cut short
                        raise ValueError(f"{path}: line {bad} is not a batch result record (is this an output "
                                         "file of an earlier run of this batch?)")
                    record = _record(raw)
                    if record is None:  # the last line, cut by a crash, is redone; any other is an error
                        bad = n
                        continue
                    keep += len(raw)
                    self._note(record)
            if keep < path.stat().st_size:
                logger.warning("%s: dropping a half-written last line (its request is run again)", path)
                os.truncate(path, keep)
        return open(path, "ab")

    def _note(self, record: dict) -> None:
        if record.get("line") is not None:
            self.done_lines.add(record["line"])
        else:
            self.done_ids.add(record["custom_id"])
        if record_ok(record):
            self.completed += 1
        else:
            self.failed += 1

    def write(self, record: dict, ok: bool) -> None:
        """Append ``record`` (to the error file when not ``ok`` and there is one), flushed."""
        f = self._out if ok else self._err
        f.write((json.dumps(record) + "\n").encode("utf-8"))
        f.flush()
        self._note(record)

    def close(self) -> None:
        self._out.close()
        self._err.close()

    def __enter__(self) -> "ResultFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _record(raw: bytes) -> dict | None:
    """The result record on one file line, or None (cut short, or not a record)."""
    if not raw.endswith(b"\n"):
        return None
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(record, dict) or "custom_id" not in record or "response" not in record:
        return None
    return record
