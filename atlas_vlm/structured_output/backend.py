"""The grammar library behind structured output, behind one small interface.

``StructuredOutputBackend`` compiles a ``StructuredOutputsParams`` for one tokenizer into a
``StructuredOutputGrammar`` (one request's matcher): ``fill_bitmask`` writes the allowed next
tokens into a row of an int32 token bitmask (bit ``i % 32`` of word ``i // 32`` is token
``i``, the layout llguidance and xgrammar share), ``accept_token`` advances it.

The backend is llguidance (measured against xgrammar on this machine, see
docs/structured-output.md): compiling a schema takes under 1 ms against 20-60 ms, and masks cost
tens of microseconds a token either way. Another library is one more subclass.
"""

from __future__ import annotations

import abc

import torch

from atlas_vlm.structured_output.params import StructuredOutputsParams, ascii_regex, choice_regex


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row for ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def allocate_token_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """``[rows, ceil(vocab_size / 32)]`` int32, all bits set (every token allowed)."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


_BYTE_TABLES: dict[tuple, torch.Tensor] = {}


def _byte_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[256, 8]``: row ``b`` holds 0 where bit ``i`` of byte ``b`` is set, else ``-inf``."""
    key = (dtype, device)
    if key not in _BYTE_TABLES:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        _BYTE_TABLES[key] = torch.where(bits.bool(), 0.0, float("-inf")).to(dtype=dtype, device=device)
    return _BYTE_TABLES[key]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` with every token whose bit is 0 set to ``-inf``, in one vectorised pass:
    each byte of the mask looks up its 8 additive values (0 or ``-inf``) in a 256-row table
    (2x faster here than unpacking bits with shifts).

    Args:
        logits: ``[rows, vocab]`` float with no ``+inf`` / NaN (the sampler replaces such rows first).
        bitmask: ``[rows, words]`` int32, ``words * 32 >= vocab`` (bits past ``vocab`` ignored;
            little-endian words: bit ``i % 32`` of word ``i // 32`` is token ``i``).

    Returns: a new ``[rows, vocab]`` tensor.

    Raises:
        ValueError: the bitmask's shape does not cover the logits.
    """
    rows, vocab = logits.shape
    if bitmask.dim() != 2 or bitmask.shape[0] != rows or bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"bitmask of shape {tuple(bitmask.shape)} does not cover logits of shape {(rows, vocab)}")
    as_bytes = bitmask.to(logits.device).contiguous().view(torch.uint8).long()  # [rows, words * 4]
    additive = _byte_table(logits.dtype, logits.device)[as_bytes].view(rows, -1)[:, :vocab]
    return logits + additive


def grammar_spec(params: StructuredOutputsParams) -> tuple[str, object]:
    """``(library kind, spec)``: "json" with a schema, "regex" or "lark" with a string (a
    regex with ASCII ``\\d \\w \\s``: ``ascii_regex``)."""
    kind = params.kind
    if kind == "json":
        return "json", params.json
    if kind == "json_object":
        return "json", {"type": "object"}
    if kind == "regex":
        return "regex", ascii_regex(params.regex)
    if kind == "choice":
        return "regex", choice_regex(params.choice)
    return "lark", params.grammar


class StructuredOutputGrammar(abc.ABC):
    """One request's grammar state (a matcher)."""

    @abc.abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it."""

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (EOS only where the grammar accepts)."""

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """The grammar has ended: nothing but EOS could follow (or EOS was accepted)."""

    @abc.abstractmethod
    def error(self) -> str | None:
        """Why the matcher failed, if it did."""

    @abc.abstractmethod
    def validate_tokens(self, token_ids: list[int]) -> int:
        """How many of ``token_ids``, from the start, the grammar would accept in a row from
        its current state (nothing is consumed)."""

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    def fill_draft_bitmasks(self, bitmask: torch.Tensor, first_row: int, drafts: list[int]) -> None:
        """``bitmask[first_row + j]`` = the allowed tokens after ``drafts[:j]``, for ``j`` in
        ``0 .. len(drafts)`` (speculative decoding's verified rows, as vLLM fills them with
        xgrammar / llguidance rollback). The drafts are accepted one by one to fill the rows,
        then all rolled back: the state afterwards is exactly the state before. Once a draft
        ends the grammar, the drafts after it are not accepted (the library would not record
        them) and their rows keep the ended grammar's mask: the request stops at that draft
        if it is taken, so those rows are never taken.

        Raises:
            ValueError: the grammar refuses a draft (drafts must be cut to
                ``validate_tokens`` first); the state is restored before raising.
        """
        done = 0
        try:
            for j, token in enumerate(drafts):
                self.fill_bitmask(bitmask, first_row + j)
                if self.is_terminated():
                    bitmask[first_row + j + 1:first_row + len(drafts) + 1] = bitmask[first_row + j]
                    return
                if not self.accept_token(token):
                    raise ValueError(f"draft token {token} at {j} is not allowed by the grammar")
                done += 1
            self.fill_bitmask(bitmask, first_row + len(drafts))
        finally:
            if done:
                self.rollback(done)


class StructuredOutputBackend(abc.ABC):
    """Compiles grammars for one tokenizer.

    Args:
        tokenizer: the model's transformers (fast) tokenizer.
        vocab_size: the model's logits width (may exceed ``len(tokenizer)``; ids past the
            tokenizer are never allowed).
        eos_token_ids: ids that end a request; allowed where the grammar accepts.
    """

    mask_vocab_size: int  # bits per bitmask row, >= vocab_size

    @abc.abstractmethod
    def compile_grammar(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        """A fresh matcher for ``params``. Raises ValueError if the grammar is refused."""

    def fill_bitmasks(self, grammars: list[StructuredOutputGrammar], bitmask: torch.Tensor) -> None:
        """``bitmask[k]`` from ``grammars[k]`` for every k (a library may do them in parallel)."""
        for k, grammar in enumerate(grammars):
            grammar.fill_bitmask(bitmask, k)


class GuidanceGrammar(StructuredOutputGrammar):
    def __init__(self, matcher):
        self.matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return bool(self.matcher.consume_token(token_id))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_stopped())

    def error(self) -> str | None:
        return self.matcher.get_error() or None

    def validate_tokens(self, token_ids: list[int]) -> int:
        return int(self.matcher.validate_tokens(list(token_ids))) if token_ids else 0

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self.matcher.rollback(num_tokens):
            raise RuntimeError(f"the grammar could not roll back {num_tokens} tokens: {self.error()}")


def _ll_grammar(params: StructuredOutputsParams) -> str:
    import llguidance

    kind, spec = grammar_spec(params)
    if kind == "json":
        # whitespace as in json.dumps' default separators; keys in the schema's order
        return llguidance.LLMatcher.grammar_from_json_schema(
            spec, defaults={"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "})
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    return llguidance.LLMatcher.grammar_from_lark(spec)


def validate(params: StructuredOutputsParams) -> None:
    """Check the spec without a tokenizer.

    Raises:
        ValueError: the library's message (naming the unsupported feature or syntax error).
    """
    import llguidance

    try:
        err = llguidance.LLMatcher.validate_grammar(_ll_grammar(params), None)
    except (ValueError, TypeError, RuntimeError) as e:
        err = str(e)
    if err:
        raise ValueError(f"structured_outputs.{params.kind} is not supported: {err}")


def _tokenizer_json(tokenizer) -> str:
    """The tokenizer's ``tokenizer.json`` for llguidance, with one fix: a byte-level BPE
    whose decoder is a ``Sequence`` that also holds SentencePiece steps (``ByteFallback``,
    ``Replace('▁')``; what transformers' GGUF conversion writes for SmolLM2) gets its plain
    ``ByteLevel`` decoder, else llguidance reads ``Ġ`` as the text 'Ġ' and its masks allow
    tokens by the wrong bytes."""
    import copy
    import json

    backend = copy.copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    spec = json.loads(backend.to_str())
    decoder = spec.get("decoder") or {}
    if decoder.get("type") == "Sequence":
        levels = [d for d in decoder.get("decoders", []) if d.get("type") == "ByteLevel"]
        vocab = spec.get("model", {}).get("vocab", {})
        if levels and "<0x00>" not in vocab:
            spec["decoder"] = levels[0]
            if spec.get("model", {}).get("byte_fallback"):
                spec["model"]["byte_fallback"] = False
    return json.dumps(spec)


class GuidanceBackend(StructuredOutputBackend):
    """llguidance (``pip install llguidance``)."""

    name = "guidance"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        import llguidance

        self.vocab_size = vocab_size
        n_vocab = max(vocab_size, len(tokenizer))
        self.mask_vocab_size = n_vocab  # bits per bitmask row (>= the logits width)
        self._executor = None  # llguidance.LLExecutor, made on the first batch of masks
        self._compiled: dict[str, object] = {}  # grammar text -> pristine LLMatcher (LRU, insertion order)
        eos = sorted(eos_token_ids) or None
        self.ll_tokenizer = llguidance.LLTokenizer(_tokenizer_json(tokenizer), n_vocab=n_vocab,
                                                   eos_token=eos if eos is not None else tokenizer.eos_token_id)
        # the first mask over a tokenizer builds the library's token tables (~1.5 s for 150k
        # tokens on this CPU): pay it here, once, not inside an engine step
        warm = self.compile_grammar(StructuredOutputsParams(regex="a"))
        warm.fill_bitmask(allocate_token_bitmask(1, n_vocab), 0)

    def fill_bitmasks(self, grammars: list[GuidanceGrammar], bitmask: torch.Tensor) -> None:
        """All rows at once on llguidance's thread pool (outside the GIL)."""
        if len(grammars) < 2:
            return super().fill_bitmasks(grammars, bitmask)
        import llguidance
        import llguidance.torch

        if self._executor is None:
            self._executor = llguidance.LLExecutor(max(1, torch.get_num_threads()))
        llguidance.torch.fill_next_token_bitmask_par(self._executor, [(g.matcher, k) for k, g in enumerate(grammars)],
                                                     bitmask)

    def clear_compiled(self) -> None:
        """Forget the compiled grammars (the next compile of each starts from scratch)."""
        self._compiled.clear()

    def compile_grammar(self, params: StructuredOutputsParams) -> GuidanceGrammar:
        """A fresh matcher; the same grammar compiled before (the last 64 kept) is copied
        from its pristine matcher instead of compiled again."""
        import llguidance

        grammar = _ll_grammar(params)
        pristine = self._compiled.pop(grammar, None)
        if pristine is None:
            pristine = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
            err = pristine.get_error()
            if err:
                raise ValueError(f"structured_outputs.{params.kind} cannot be compiled: {err}")
        self._compiled[grammar] = pristine  # most recent last
        while len(self._compiled) > 64:
            self._compiled.pop(next(iter(self._compiled)))
        return GuidanceGrammar(pristine.deep_copy())
