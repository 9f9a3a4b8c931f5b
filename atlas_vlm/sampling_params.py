"""``SamplingParams``: how one request picks its next tokens and when it stops (vLLM names).

Every value is checked where it enters: on creation and again on every assignment, and the
limits that depend on the model (vocabulary) by ``check_for_model`` when a request is added.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import struct
from dataclasses import dataclass, field
from numbers import Real

from atlas_vlm.structured_output.params import StructuredOutputsParams

# vLLM vllm/sampling_params.py: temperatures below this are treated as greedy (argmax),
# which also keeps ``logits / temperature`` from overflowing to inf (fp32 max ~3.4e38).
SAMPLING_EPS = 1e-5
# vLLM ModelConfig.max_logprobs default: top logprobs per token at most.
MAX_LOGPROBS = 20
# torch.Generator.manual_seed's range; top_k goes into an int64 tensor.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
_INT64_MAX = 2**63 - 1
# OpenAI's ranges: frequency / presence penalties in [-2, 2], a logit_bias value in [-100, 100]
_PENALTY_MAX, _LOGIT_BIAS_MAX = 2.0, 100.0


class SamplingParamsError(ValueError):
    """A bad ``SamplingParams`` value; ``param`` names the field (the server's 400 names it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # pickles whole (an engine in another process raises it to the server)
        return type(self), (self.param, str(self))


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a request holds (vLLM ``vllm.sampling_params.RequestOutputKind``).

    - ``CUMULATIVE``: every output holds everything so far (``text``, ``token_ids``,
      ``logprobs`` from the first generated token on); ``LLM.generate`` / ``LLM.chat``'s default.
    - ``DELTA``: every output holds only what its step added (``text``, ``token_ids``,
      ``logprobs``, ``top_logprobs`` are the step's new entries; ``prompt_token_ids`` only in
      a request's first output, ``[]`` after): concatenated they give the cumulative output.
      A step may add ids but no text (a stop string could still start there).
    - ``FINAL_ONLY``: one output, when the request finishes, holding everything.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _as_float32(x: float) -> float:
    """``x`` rounded to fp32 as the sampler's tensors hold it (0.0 below fp32's smallest
    subnormal, inf above its max)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.inf


def is_greedy(temperature: float) -> bool:
    """Greedy when ``temperature < SAMPLING_EPS`` (vLLM ``_SAMPLING_EPS``)."""
    return temperature < SAMPLING_EPS


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """Sampling and stopping rules of one request.

    First, on the raw logits (vLLM's order): ``logit_bias`` is added, then
    ``repetition_penalty`` (HF / vLLM: every token seen in the prompt or the output has a
    positive logit divided by it, a negative one multiplied), then OpenAI's
    ``logits[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)`` over the
    output tokens. ``temperature < 1e-5`` (0 included) is greedy (argmax of those logits).
    Otherwise they are divided by the temperature, cut to the ``top_k`` best, the smallest set
    whose probability reaches ``top_p``, and the tokens whose probability is at least ``min_p``
    times the best's (HF's warper order), and sampled with a generator seeded by ``seed``
    (reproducible per request). A ``top_k`` larger than the vocabulary keeps the whole vocabulary.

    Raises:
        ValueError: on creation or assignment, naming the bad field and the allowed range;
            an unknown field name is refused too.
    """

    temperature: float = 1.0  # < 1e-5: greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0  # in [0, 1]: keep tokens with probability >= min_p * the top one's; 0: off
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted from every token the output holds
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted once per occurrence in the output
    repetition_penalty: float = 1.0  # > 0: divides (> 0) / multiplies (< 0) seen tokens' logits; 1: off
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100], added to its logit
    seed: int | None = None  # per-request RNG seed; None: the engine's seed + request index
    max_tokens: int | None = 16  # generated tokens at most; None: up to max_model_len
    stop_token_ids: list[int] = field(default_factory=list)  # stop after emitting one of these (None: [])
    stop: list[str] = field(default_factory=list)  # stop strings, excluded from the text (a str: [str]; None: [])
    ignore_eos: bool = False  # keep going past the tokenizer's EOS
    logprobs: int | None = None  # None: none; 0..MAX_LOGPROBS: sampled token's logprob plus the top k
    # output constraint (JSON schema, regex, choice, grammar); a dict is read as its fields
    structured_outputs: StructuredOutputsParams | None = None
    # what each output holds: everything so far, the step's delta, or one output at the end
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        for name in ("stop", "stop_token_ids"):  # None: none (as vLLM)
            if getattr(self, name) is None:
                object.__setattr__(self, name, [])
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        if not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop", list(self.stop))
        object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", dict(self.logit_bias) or None)  # a copy; {}: None
        if isinstance(self.structured_outputs, dict):
            try:
                so = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:  # an unknown key
                raise ValueError(f"structured_outputs: {e}; keys: json, json_object, regex, choice, grammar") from None
            object.__setattr__(self, "structured_outputs", so)
        self._validate()
        object.__setattr__(self, "_ready", True)

    def __setattr__(self, name: str, value) -> None:
        if not getattr(self, "_ready", False):
            object.__setattr__(self, name, value)
            return
        names = [f.name for f in dataclasses.fields(self)]
        if name not in names:
            raise ValueError(f"SamplingParams has no field {name!r}; fields: {', '.join(names)}")
        checked = dataclasses.replace(self, **{name: value})  # runs every check on a copy
        object.__setattr__(self, name, getattr(checked, name))

    def _validate(self) -> None:
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0.0:
            raise SamplingParamsError("temperature", f"temperature must be >= 0 and finite "
                                      f"(< {SAMPLING_EPS}: greedy), got {t!r}")
        if not is_greedy(t) and math.isinf(_as_float32(t)):
            raise SamplingParamsError("temperature", f"temperature must be finite in float32 (at most ~3.4e38), "
                                      f"got {t!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if _as_float32(self.top_p) == 0.0:  # the fp32 nucleus test would mask every token
            raise SamplingParamsError("top_p", f"top_p must be in (0, 1] and not round to 0 in float32 "
                                      f"(>= 1.4e-45), got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1 or self.top_k > _INT64_MAX:
            raise SamplingParamsError("top_k", f"top_k must be an int, -1 or 0 (off) or in [1, 2**63 - 1], "
                                      f"got {self.top_k!r}")
        self._validate_penalties()
        if self.seed is not None and (not _is_int(self.seed) or not _SEED_MIN <= self.seed <= _SEED_MAX):
            raise SamplingParamsError("seed", f"seed must be an int in [-2**63, 2**64 - 1] or None, "
                                      f"got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an int >= 1 or None, got {self.max_tokens!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or >= 0, got {self.logprobs!r}")
        if self.logprobs is not None and self.logprobs > MAX_LOGPROBS:
            raise ValueError(f"logprobs must be at most MAX_LOGPROBS={MAX_LOGPROBS} (vLLM's max_logprobs), "
                             f"got {self.logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY), "
                             f"got {self.output_kind!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, a dict of its fields or None, "
                             f"got {type(self.structured_outputs).__name__}")

    def _validate_penalties(self) -> None:
        m = self.min_p
        if not _is_real(m) or not 0.0 <= m <= 1.0:
            raise SamplingParamsError("min_p", f"min_p must be in [0, 1], got {m!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -_PENALTY_MAX <= v <= _PENALTY_MAX:
                raise SamplingParamsError(name, f"{name} must be in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if not _is_real(r) or not 0.0 < r < math.inf or not 0.0 < _as_float32(r) < math.inf:
            raise SamplingParamsError("repetition_penalty", f"repetition_penalty must be > 0 and finite in "
                                      f"float32 (1: off), got {r!r}")
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise SamplingParamsError("logit_bias", f"logit_bias must be a dict of token id -> bias or None, "
                                      f"got {type(self.logit_bias).__name__}")
        for t, b in self.logit_bias.items():
            if not _is_int(t) or t < 0:
                raise SamplingParamsError("logit_bias", f"logit_bias keys must be token ids (ints >= 0), got {t!r}")
            if not _is_real(b) or not -_LOGIT_BIAS_MAX <= b <= _LOGIT_BIAS_MAX:
                raise SamplingParamsError("logit_bias", f"logit_bias values must be in [-100, 100], "
                                          f"got {b!r} for token {t}")

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)

    @property
    def uses_penalties(self) -> bool:
        """Whether ``logit_bias`` or a penalty changes the raw logits (``worker.penalties``)."""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 or bool(self.frequency_penalty) \
            or bool(self.presence_penalty)


def check_for_model(params: SamplingParams, vocab_size: int) -> None:
    """The limits that depend on the model, checked when a request is added.

    Raises:
        ValueError: a stop token id is not a token of this model (``>= vocab_size``);
            ``SamplingParamsError`` (param ``logit_bias``) for a ``logit_bias`` key that is not.
    """
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids {bad} are not tokens of this model (vocab_size {vocab_size})")
    bad = sorted(t for t in (params.logit_bias or {}) if t >= vocab_size)
    if bad:
        raise SamplingParamsError("logit_bias", f"logit_bias keys {bad[:8]} are not tokens of this model "
                                  f"(vocab_size {vocab_size})")
