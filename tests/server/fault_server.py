"""``python tests/server/fault_server.py [serve args]``: ``atlas-vlm serve`` with faults that
only tests inject, keyed on the prompt text (a chat request's prompt ids decoded with the model
folder's tokenizer, the first argument; never part of the package):

- a prompt holding ``FAULT-STEP`` makes the step that computes it raise (an unexpected
  engine fault, not one request's parameters);
- a prompt holding ``SLOW-STEP`` makes its first (prefill) step take ``ATLAS_TEST_SLOW_S``
  seconds (default 6), after touching the file ``ATLAS_TEST_SLOW_MARKER`` (if set), as a
  long prefill would;
- a prompt holding ``SLOW-DECODE`` makes every step it is in take 20 ms more (a request that
  stays running for a while, whatever the machine's speed).
"""

from __future__ import annotations

import os
import sys
import time

from atlas_vlm.worker.model_runner import ModelRunner

_forward_logits = ModelRunner.forward_logits


_prompt_texts: dict[str, str] = {}  # request id -> its prompt as text (chat requests carry ids only)


def _prompt_text(req) -> str:
    if req.prompt:
        return req.prompt
    if req.request_id not in _prompt_texts:
        from transformers import AutoTokenizer

        tok = _prompt_text.tokenizer = getattr(_prompt_text, "tokenizer", None) or AutoTokenizer.from_pretrained(
            sys.argv[1])
        _prompt_texts[req.request_id] = tok.decode(req.token_ids[:req.num_prompt_tokens])
    return _prompt_texts[req.request_id]


def _faulty_forward_logits(self, chunks):
    for req, _n in chunks:
        text = _prompt_text(req)
        if "FAULT-STEP" in text:
            raise RuntimeError("injected step fault (tests/server/fault_server.py)")
        if "SLOW-STEP" in text and req.num_computed_tokens == 0:
            marker = os.environ.get("ATLAS_TEST_SLOW_MARKER")
            if marker:
                open(marker, "w").close()
            time.sleep(float(os.environ.get("ATLAS_TEST_SLOW_S", "6")))
        if "SLOW-DECODE" in text:
            time.sleep(0.02)
    return _forward_logits(self, chunks)


ModelRunner.forward_logits = _faulty_forward_logits

if __name__ == "__main__":
    from atlas_vlm.entrypoints.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
