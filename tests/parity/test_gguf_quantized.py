"""GGUF tensors as stored (``quantization="gguf"``): every supported block format decodes to
exactly what the ``gguf`` package's own dequantizer gives; the embedded SmolLM2-135M Q4_1
GGUF loads without a dense copy and agrees with the dense fp32 run (its dequantized
weights), teacher-forced, within measured bounds; unsupported types are refused by name (the
other GGUF types: test_gguf_types)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from atlas_vlm import LLM, SamplingParams
from atlas_vlm.default_models import default_text_model
from atlas_vlm.layers.gguf_stored import GGUFDequantLinear, GGUFEmbedding
from atlas_vlm.layers.quant_linear import Int4Linear, Int8Linear
from atlas_vlm.quantization import UnsupportedQuantizationError
from atlas_vlm.quantization.gguf import DECODERS, _module_for

pytestmark = pytest.mark.text

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis briefly.",
           "List three prime numbers.", "Who wrote Hamlet?"]
N_TOKENS = 24
# teacher-forced top-1 agreement with the dense fp32 run over 5 prompts x 24 positions
MIN_AGREEMENT_REFERENCE = 1.0  # dequantized reference path: the same weights (measured 120/120)


def _blocks(kind: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    qtype = GGMLQuantizationType[kind]
    if kind == "Q4_K":  # gguf-py cannot quantize Q4_K: random bytes with sane fp16 scales
        data = rng.integers(0, 256, size=(rows, k // 256, 144), dtype=np.uint8)
        data[..., :4] = rng.uniform(0.001, 0.05, size=(rows, k // 256, 2)).astype(np.float16).view(np.uint8)
        return data.reshape(rows, -1)
    return quantize(rng.standard_normal((rows, k)).astype(np.float32), qtype)


def _to_dense(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None) -> torch.Tensor:
    """``q * scale (+ min)`` per block of 32, in fp32 (a multiply, then an add)."""
    n, k = q.shape
    w = q.float().view(n, -1, 32) * scales[..., None]
    return (w if mins is None else w + mins[..., None]).view(n, k)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q4_K"])
def test_block_decoders_equal_gguf_dequantize(kind):
    rows, k = 40, 512  # 40 rows: the module's last tile is padded
    data = _blocks(kind, rows, k)
    want = torch.from_numpy(dequantize(data, GGMLQuantizationType[kind]).reshape(rows, k).astype(np.float32))
    decoded = DECODERS[kind](data)  # int8: (q, scales); int4: (q, scales, mins), W = q * scale + min
    q, scales = decoded[:2]
    assert q.shape == (rows, k) and len(decoded) == (2 if kind == "Q8_0" else 3)
    assert all(t.shape == (rows, k // 32) for t in decoded[1:])
    assert torch.equal(_to_dense(*decoded), want)  # every kind bit-exact
    # into a module: the same bits back, fp16 scales where GGUF's are fp16 (Q4_K's d * sc are not)
    m = Int8Linear(k, rows, group_size=32) if kind == "Q8_0" else Int4Linear(k, rows, group_size=32)
    m.load_rows(0, *decoded)
    m.finalize(True)
    assert m.scales.dtype == (torch.float32 if kind == "Q4_K" else torch.float16)
    assert torch.equal(m.dequantize(), want)
    if kind == "Q4_0":
        assert torch.equal(decoded[2], -8 * scales)


class _FakeTensor:
    def __init__(self, name, kind):
        self.name, self.tensor_type = name, GGMLQuantizationType[kind]


def test_unsupported_gguf_types_are_refused_by_name():
    lin = torch.nn.Linear(64, 64, bias=False)
    with pytest.raises(UnsupportedQuantizationError, match=r"blk\.0\.attn_v\.weight has type IQ2_XXS"):
        _module_for([_FakeTensor("blk.0.attn_q.weight", "Q4_K"), _FakeTensor("blk.0.attn_v.weight", "IQ2_XXS")], lin)
    with pytest.raises(UnsupportedQuantizationError, match=r"mix types \['F16', 'Q8_0'\]"):
        _module_for([_FakeTensor("blk.0.attn_q.weight", "Q8_0"), _FakeTensor("blk.0.attn_k.weight", "F16")], lin)
    # int8 and int4 types in one projection: one Int8Linear (test_gguf_types covers the values)
    assert isinstance(_module_for([_FakeTensor("a", "Q8_0"), _FakeTensor("b", "Q4_0")], lin), Int8Linear)
    assert isinstance(_module_for([_FakeTensor("a", "Q4_1"), _FakeTensor("b", "Q4_K")], lin), Int4Linear)
    assert isinstance(_module_for([_FakeTensor("a", "Q8_0")], lin), Int8Linear)


def _teacher_forced_top1(llm: LLM, prefixes: list[list[int]]) -> list[int]:
    outs = llm.generate(prefixes, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return [o.token_ids[0] for o in outs]


@pytest.fixture(scope="module")
def smollm2_runs():
    path = default_text_model()
    dense = LLM(path, quantization="dequantize", dtype="float32", max_model_len=512)
    tok = dense.engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False)
               for p in PROMPTS]
    outs = dense.generate(prompts, SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True), use_tqdm=False)
    prefixes = [p + o.token_ids[:i] for p, o in zip(prompts, outs) for i in range(N_TOKENS)]
    want = [t for o in outs for t in o.token_ids]
    return path, prefixes, want


def test_smollm2_gguf_as_stored_equals_the_dense_copy(smollm2_runs):
    """The embedded SmolLM2 (Q4_1 projections, tied Q8_0 table; rows of 576, not whole 256-value
    super-blocks) loads as stored by default: each projection dequantized once from the file's
    blocks into a plain nn.Linear (exactly gguf's values), the table looked up row by row: the dense copy's weights, so
    its tokens, teacher-forced."""
    path, prefixes, want = smollm2_runs
    llm = LLM(path, dtype="float32", max_model_len=512)
    model = llm.engine.runner.model
    lin = [m for m in model.modules() if type(m) is torch.nn.Linear]  # each kept as its dense copy
    assert len(lin) == 30 * 4 + 1 and isinstance(model.model.embed_tokens, GGUFEmbedding)
    assert type(model.lm_head) is torch.nn.Linear and not any(isinstance(m, GGUFDequantLinear) for m in model.modules())
    got = _teacher_forced_top1(llm, prefixes)
    assert sum(a == b for a, b in zip(got, want)) / len(want) >= MIN_AGREEMENT_REFERENCE
    assert llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].text.find("Paris") >= 0
