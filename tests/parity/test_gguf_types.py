"""The GGUF types people download (Q4_K_M / Q5_K_M / Q6_K files hold Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
next to Q4_K; also Q3_K, Q2_K, IQ4_NL, IQ4_XS): random raw blocks decode to exactly what the
``gguf`` package's ``dequantize`` gives; the converted modules (one type or a fused projection
mixing types) compute ``F.linear`` with that weight, kernel on and off; a type we do not run is
refused by name before any work. ``write_gguf`` makes the small random Q4_K_M-like model that
test_gguf_stored loads as stored."""

from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize

from helpers import require_quant_kernel

from atlas_vlm.default_models import default_text_model
from atlas_vlm.kernels import cbuild, quant_kernel
from atlas_vlm.layers.quant_linear import Int4Linear, Int8Linear, quantize_activations
from atlas_vlm.quantization import UnsupportedQuantizationError
from atlas_vlm.quantization import gguf as gguf_loader
from atlas_vlm.quantization import gguf_stored
from atlas_vlm.quantization.gguf import _load_rows, _module_for
from atlas_vlm.quantization.gguf_types import DECODERS, group_of, int8_form

pytestmark = pytest.mark.text

KINDS = list(DECODERS)
# byte offsets of a block's fp16 fields (d, then dmin / m) and the largest |q * sc| a d multiplies
# (ggml-common.h's block structs): d = amp / that, so |W| stays near amp
FP16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q5_0": [0], "Q5_1": [0, 2],
               "Q5_K": [0, 2], "Q6_K": [208], "Q3_K": [108], "Q2_K": [80, 82], "IQ4_NL": [0], "IQ4_XS": [0]}
Q_RANGE = {"Q8_0": 127, "Q4_0": 8, "Q4_1": 15, "Q4_K": 63 * 15, "Q5_0": 16, "Q5_1": 31, "Q5_K": 63 * 31,
           "Q6_K": 128 * 32, "Q3_K": 32 * 4, "Q2_K": 15 * 3, "IQ4_NL": 127, "IQ4_XS": 32 * 127}
KERNEL_FP32_REL = 5e-6  # kernel vs kernel_reference (test_quant_linear: only the fp32 summation order differs)


def random_blocks(kind: str, rows: int, k: int, rng: np.random.Generator, amp: float = 1.0) -> np.ndarray:
    """``[rows, bytes a row]`` uint8: random quants / scale bytes, finite fp16 ``d`` (random
    sign, ``|W|`` up to about ``amp``) and ``dmin`` / ``m``."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    data = rng.integers(0, 256, size=(rows, k // block, size), dtype=np.uint8)
    for i, off in enumerate(FP16_FIELDS.get(kind, [0])):  # (another type: its d first, as IQ2_XXS)
        v = rng.uniform(0.3, 1.0, size=(rows, k // block)) * amp / (Q_RANGE.get(kind, 1) if i == 0 else 32)
        v = v * (rng.choice([-1, 1], size=v.shape) if i == 0 else 1)
        data[..., off:off + 2] = v.astype(np.float16)[..., None].view(np.uint8)
    return data.reshape(rows, -1)


class _Tensor:
    """What the loader reads of a ``GGUFReader`` tensor (GGUF lists dims reversed)."""

    def __init__(self, name, kind, data, k):
        self.name, self.tensor_type, self.data = name, GGMLQuantizationType[kind], data
        self.shape = (k, data.shape[0])


def _dense(data: np.ndarray, kind: str, k: int) -> torch.Tensor:
    return torch.from_numpy(dequantize(data, GGMLQuantizationType[kind]).reshape(-1, k).astype(np.float32))


@pytest.mark.parametrize("kind", KINDS)
def test_decoders_are_bit_exact(kind):
    rows, k = 40, 512
    data = random_blocks(kind, rows, k, np.random.default_rng(KINDS.index(kind)))
    q, scales, *mins = DECODERS[kind](data)
    g = group_of(kind)
    assert q.shape == (rows, k) and scales.shape == (rows, k // g) and q.dtype in (torch.int8, torch.uint8)
    w = q.float().view(rows, -1, g) * scales[..., None]
    w = (w + mins[0][..., None] if mins else w).view(rows, k)
    want = _dense(data, kind, k)
    assert want.isfinite().all() and want.abs().max() > 0.1 and torch.equal(w, want)


# one module per fused projection: every int4 part -> Int4Linear, else one Int8Linear (group, mins)
PROJECTIONS = [[k] for k in KINDS] + [["Q4_K", "Q4_K", "Q6_K"], ["Q5_0", "Q8_0", "IQ4_NL"], ["Q4_0", "Q5_1"],
                                      ["Q4_1", "Q4_K"], ["IQ4_XS", "Q2_K"]]


@pytest.mark.parametrize("kinds", PROJECTIONS, ids=["+".join(p) for p in PROJECTIONS])
@pytest.mark.parametrize("kernel", [False, True])
def test_modules_compute_linear_with_the_gguf_weight(kinds, kernel):
    if kernel:
        require_quant_kernel()
    k, rows, rng = 512, [40, 24, 16], np.random.default_rng(7)
    parts = [_Tensor(f"p{i}", kind, random_blocks(kind, rows[i], k, rng), k) for i, kind in enumerate(kinds)]
    m = _module_for(parts, torch.nn.Linear(k, sum(rows[:len(kinds)]), bias=False))
    assert isinstance(m, Int4Linear if set(kinds) <= {"Q4_0", "Q4_1", "Q4_K"} else Int8Linear)
    if isinstance(m, Int8Linear):
        assert m.group_size == min(group_of(x) for x in kinds)
        assert m.has_min == bool(set(kinds) & {"Q4_1", "Q4_K", "Q5_1", "Q5_K", "Q2_K"})
    row = 0
    for t in parts:
        row += _load_rows(m, row, t, None)
    want_w = torch.cat([_dense(t.data, t.tensor_type.name, k) for t in parts])
    m.finalize(kernel)
    assert m.use_kernel == kernel  # groups of 16 too
    assert torch.equal(m.dequantize(), want_w)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1))
    got = m(x)
    if not kernel:
        assert torch.equal(got, F.linear(x, want_w))
        return
    want = m.kernel_reference(x)
    assert ((got - want).abs().max() / want.abs().max()).item() <= KERNEL_FP32_REL
    # vs F.linear: the kernel's int8 activations move each output by at most |W| @ |x - xq|
    bound = F.linear((x - quantize_activations(x)).abs(), want_w.abs()) + 1e-5 * F.linear(x.abs(), want_w.abs())
    assert ((got - F.linear(x, want_w)).abs() <= bound).all()


def test_bad_int8_forms_are_refused_by_name():
    q, s = torch.zeros(16, 64, dtype=torch.int8), torch.ones(16, 2)
    with pytest.raises(ValueError, match="mins missing for an Int8Linear with has_min=True"):
        Int8Linear(64, 16, group_size=32, has_min=True).load_rows(0, q, s)
    with pytest.raises(ValueError, match="mins given to an Int8Linear with has_min=False"):
        Int8Linear(64, 16, group_size=32).load_rows(0, q, s, s)
    data = random_blocks("Q8_0", 16, 64, np.random.default_rng(0))
    with pytest.raises(ValueError, match="GGUF Q8_0 has a scale per 32 inputs; cannot take group 64"):
        int8_form("Q8_0", data, 64, False)
    with pytest.raises(ValueError, match="GGUF Q5_1 has mins"):
        int8_form("Q5_1", random_blocks("Q5_1", 16, 64, np.random.default_rng(0)), 32, False)


def test_c_dequantize_of_groups_of_16_has_the_pytorch_bits():
    require_quant_kernel()
    k, rows = 512, 40
    data = random_blocks("Q2_K", rows, k, np.random.default_rng(3))  # group 16 with mins
    m = _module_for([_Tensor("p", "Q2_K", data, k)], torch.nn.Linear(k, rows, bias=False))
    _load_rows(m, 0, _Tensor("p", "Q2_K", data, k), None)
    m.finalize(True)
    plain = quant_kernel.load_variant([*cbuild.BASE_FLAGS, "-ffp-contract=off"])
    for dtype in (torch.float32, torch.bfloat16):
        want = m.dequantize(dtype)
        for lib in (None, plain):  # this CPU's variant and plain C
            got = quant_kernel.dequantize(m.qweight, m.scales, m._mins(), rows, k, 16, dtype, lib=lib)
            assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


# ---- a small model written as a GGUF ------------------------------------------------------------

HIDDEN, INTER, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 3
LAYER_TYPES = [  # Q4_K_M-like: Q4_K with a Q6_K attn_v / ffn_down; then the other types
    dict(attn_q="Q4_K", attn_k="Q4_K", attn_v="Q6_K", attn_output="Q4_K", ffn_gate="Q4_K", ffn_up="Q4_K",
         ffn_down="Q6_K"),
    dict(attn_q="Q5_0", attn_k="Q5_0", attn_v="Q8_0", attn_output="Q5_K", ffn_gate="Q5_1", ffn_up="IQ4_NL",
         ffn_down="Q3_K"),
    dict(attn_q="IQ4_XS", attn_k="Q2_K", attn_v="Q5_K", attn_output="Q4_1", ffn_gate="Q4_0", ffn_up="Q4_1",
         ffn_down="Q6_K"),
]


def write_gguf(path, layer_types, seed: int = 0) -> None:
    """A random llama-architecture GGUF at ``path``: SmolLM2's tokenizer and header fields
    (vocab 49152), our sizes, a tied Q4_K ``token_embd`` (the LM head too), projections of ``layer_types``."""
    src = GGUFReader(str(default_text_model()))
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "llama")
    for key, field in src.fields.items():
        if key.startswith("tokenizer.") or key in ("llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon"):
            sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    w.add_context_length(1024), w.add_embedding_length(HIDDEN), w.add_block_count(len(layer_types))
    w.add_feed_forward_length(INTER), w.add_head_count(HEADS), w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS), w.add_vocab_size(49152)
    w.add_tensor("token_embd.weight", random_blocks("Q4_K", 49152, HIDDEN, rng, amp=1.0),
                 raw_dtype=GGMLQuantizationType.Q4_K)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    hd = HIDDEN // HEADS
    shapes = dict(attn_q=(HEADS * hd, HIDDEN), attn_k=(KV_HEADS * hd, HIDDEN), attn_v=(KV_HEADS * hd, HIDDEN),
                  attn_output=(HIDDEN, HIDDEN), ffn_gate=(INTER, HIDDEN), ffn_up=(INTER, HIDDEN),
                  ffn_down=(HIDDEN, INTER))
    for i, types in enumerate(layer_types):
        for part in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{part}.weight", rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32))
        for part, kind in types.items():
            n, k = shapes[part]
            w.add_tensor(f"blk.{i}.{part}.weight", random_blocks(kind, n, k, rng, amp=0.15),
                         raw_dtype=GGMLQuantizationType[kind])
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-Q4_K_M-like.gguf"
    write_gguf(path, LAYER_TYPES)
    yield (path,)


def test_unsupported_type_is_refused_by_name_before_any_work(tmp_path, monkeypatch):
    types = [dict(t) for t in LAYER_TYPES[:2]]
    types[1]["ffn_up"] = "IQ2_XXS"
    path = tmp_path / "tiny-iq2.gguf"
    write_gguf(path, types)

    def no_work(*a, **k):
        raise AssertionError("work started before the type check")

    monkeypatch.setattr(gguf_stored, "gguf_config", no_work, raising=False)
    monkeypatch.setattr(gguf_stored, "build_empty", no_work)
    with pytest.raises(UnsupportedQuantizationError, match=r"blk\.1\.ffn_up\.weight has type IQ2_XXS; supported: "
                                                           r"F32, F16, BF16, Q8_0, Q5_0.*Q4_K"):
        gguf_stored.load_gguf_stored(path)


def test_dropped_pages_read_back_the_same_bytes(mixed_gguf):
    """The loader drops each converted tensor's pages from the GGUF's memory map (a load's peak
    RSS then holds the file only once): the bytes read after that are the file's, for a tensor
    that shares its first and last page with its neighbours too; a reader without an mmap is
    left alone."""
    path = mixed_gguf[0]
    reader = GGUFReader(str(path))
    before = {t.name: np.array(t.data, copy=True) for t in reader.tensors}
    for t in reader.tensors:
        gguf_loader.drop_pages(reader, t)
    for t in reader.tensors:
        np.testing.assert_array_equal(np.asarray(t.data), before[t.name], err_msg=t.name)
    assert any(int(t.data_offset) % 4096 for t in reader.tensors)  # some start inside a page

    class NoMap:
        data = np.zeros(8, np.uint8)

    gguf_loader.drop_pages(NoMap(), reader.tensors[0])  # no mmap: nothing to drop, no error
