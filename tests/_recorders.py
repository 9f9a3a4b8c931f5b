"""A recorder of what each engine step computed, shared by the text and engine tests.

``StepRecorder(llm)`` is a context manager that wraps the engine runner's
``forward_logits`` (as an instance attribute over the bound method) while the block runs,
and records:

- ``logits[request_id]``: a clone of every sampled logits row of that request (fp32,
  ``[vocab]``), in step order;
- ``chunks[request_id]``: per forward that request took part in,
  ``(num_computed_tokens_before, num_new_tokens, tuple(block_ids))`` as the step saw them;
- ``steps``: one entry per forward, the list of
  ``(request_id, num_computed_tokens_before, num_new_tokens, tuple(block_ids))`` of its
  chunks in batch order.

Chunk data is read before the forward runs (the engine advances ``num_computed_tokens``
only after it). On exit the runner's original ``forward_logits`` is restored, also when
the block raised.

(``_vlm_helpers.Recorder`` additionally records ``prepare_inputs``; this one does not.)
"""

from __future__ import annotations

from collections import defaultdict

import torch

_MISSING = object()


class StepRecorder:
    def __init__(self, llm):
        self.runner = llm.engine.runner
        self.logits: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.chunks: dict[str, list[tuple[int, int, tuple[int, ...]]]] = defaultdict(list)
        self.steps: list[list[tuple[str, int, int, tuple[int, ...]]]] = []
        self._saved = _MISSING

    def __enter__(self) -> StepRecorder:
        runner = self.runner
        # An instance attribute already there (another wrapper) is put back on exit;
        # otherwise the attribute is deleted so the class method shows through again.
        self._saved = runner.__dict__.get("forward_logits", _MISSING)
        orig = runner.forward_logits

        def recording(chunks):
            step = [(req.request_id, req.num_computed_tokens, n, tuple(req.block_table.block_ids))
                    for req, n in chunks]
            self.steps.append(step)
            for rid, computed, n, table in step:
                self.chunks[rid].append((computed, n, table))
            logits, sampled = orig(chunks)
            for row, i in enumerate(sampled):
                self.logits[chunks[i][0].request_id].append(logits[row].clone())
            return logits, sampled

        runner.forward_logits = recording
        return self

    def __exit__(self, *exc) -> None:
        if self._saved is _MISSING:
            del self.runner.forward_logits
        else:
            self.runner.forward_logits = self._saved
        self._saved = _MISSING
