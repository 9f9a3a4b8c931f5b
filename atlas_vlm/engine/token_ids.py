"""Token-id prompts in any 1-D integer form: a list or tuple of ints (numpy integer scalars
included), a 1-D integer numpy array or a 1-D integer torch tensor, as vLLM and
transformers users pass them (``tokenizer(..., return_tensors="np"/"pt")["input_ids"][0]``).
Booleans, floats and 2-D arrays are refused with an error naming the input."""

from __future__ import annotations

import numbers

import numpy as np
import torch


def is_token_id(value) -> bool:
    """True for one integer token id: an ``int`` or a numpy integer scalar (not a bool)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def is_token_id_sequence(value) -> bool:
    """True if ``value`` looks like one token-id prompt (not a list of prompts): a numpy
    array or torch tensor, or a non-empty list / tuple whose first item is a token id."""
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return True
    return isinstance(value, (list, tuple)) and bool(value) and is_token_id(value[0])


def _array_ids(ids, name: str) -> list[int]:
    kind = "tensor" if isinstance(ids, torch.Tensor) else "numpy array"
    if ids.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one prompt); got a {ids.ndim}-D {kind} of shape "
                         f"{tuple(ids.shape)}")
    if isinstance(ids, torch.Tensor):
        integer = not ids.dtype.is_floating_point and not ids.dtype.is_complex and ids.dtype != torch.bool
    else:
        integer = ids.dtype.kind in "iu"
    if not integer:
        raise ValueError(f"{name} must hold integer token ids; got a {kind} of dtype {ids.dtype}")
    return [int(t) for t in ids.tolist()]


def as_token_ids(ids, vocab_size: int, name: str = "prompt_token_ids") -> list[int]:
    """One token-id prompt as a list of Python ints, checked against the vocabulary.

    Args:
        ids: a list / tuple of ints (numpy integer scalars too), or a 1-D integer numpy
            array or torch tensor.
        vocab_size: ids must lie in ``[0, vocab_size)``.
        name: the input's name in error messages.

    Raises:
        ValueError: empty, not 1-D, a bool / float / non-integer item or dtype, or an id
            outside ``[0, vocab_size)`` (the message names ``name`` and what is wrong).
    """
    if isinstance(ids, (np.ndarray, torch.Tensor)):
        out = _array_ids(ids, name)
    elif isinstance(ids, (list, tuple)):
        bad = next((t for t in ids if not is_token_id(t)), None)
        if bad is not None:
            what = "a nested sequence (2-D input)" if isinstance(bad, (list, tuple, np.ndarray, torch.Tensor)) \
                else f"{type(bad).__name__} {bad!r:.40}"
            raise ValueError(f"{name} must be a non-empty list of ids in [0, {vocab_size}) (integers); "
                             f"it holds {what}")
        out = [int(t) for t in ids]
    else:
        raise ValueError(f"{name} must be a non-empty list of ids in [0, {vocab_size}), a 1-D integer numpy "
                         f"array or torch tensor; got {type(ids).__name__}")
    if not out:
        raise ValueError(f"{name} must be a non-empty list of ids in [0, {vocab_size}); it is empty")
    bad_id = next((t for t in out if not 0 <= t < vocab_size), None)
    if bad_id is not None:
        raise ValueError(f"{name} must be a non-empty list of ids in [0, {vocab_size}); it holds {bad_id}")
    return out
