"""``deterministic=True`` (batch-invariant mode, docs/deterministic.md): each request gets
exactly (``==``, no tolerance) the tokens and logprobs it gets alone, whatever else shares
its steps: requests of different lengths together, prefill chunked by a small
``max_num_batched_tokens`` and mixed with decode rows, speculative verification rows; in
fp32 and bf16 on tiny models (also with an int8 and a contiguous KV cache) and in bf16 on
the embedded SmolLM2-135M (12 requests together gave other tokens than alone there without
this mode). Also the pieces
(``RowTiledLinear``, ``per_row_layout``), the refusals and the CLI flags."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from helpers import REPO
from atlas_vlm import LLM, SamplingParams
from atlas_vlm.layers.batch_invariant import RowTiledLinear, per_row_layout

pytestmark = pytest.mark.text
BASE = dict(max_model_len=256, kvcache_block_size=4, num_kvcache_blocks=512, device="cpu", deterministic=True,
            speculative_disable_by_batch_size=None)  # drafts in batches too: verification rows covered
PROMPTS = [  # different lengths; the repetitive ones give the n-gram proposer drafts
    "Hello",
    "The quick brown fox jumps over the lazy dog and then runs far away into the forest.",
    "a b c d a b c d a b c d a b c",
    "one two three four five six seven eight nine ten one two three four five six seven",
    "Why is the sky blue?",
]


def greedy(max_tokens=16):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)


def outputs(llm, prompts, params):
    return [(o.token_ids, o.logprobs, o.top_logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]


def alone(llm, prompts, params):
    return [outputs(llm, p, params)[0] for p in prompts]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_linear_gives_each_row_its_one_row_bits(dtype):
    torch.manual_seed(0)
    lin = torch.nn.Linear(1536, 576, bias=True).to(dtype)  # SmolLM2's down projection: K-split differs by M
    x = torch.randn(40, 1536).to(dtype)
    tiled = RowTiledLinear(lin, tile=16)
    one = torch.cat([tiled(x[i:i + 1]) for i in range(40)])  # [40, 576], each row computed alone
    for m in (2, 5, 16, 17, 40):
        assert torch.equal(tiled(x[:m]), one[:m]), m
    assert torch.equal(tiled(x[None, 3:9]), one[None, 3:9])  # leading dims kept
    assert torch.allclose(one.float(), F.linear(x, lin.weight, lin.bias).float(), atol=0.05, rtol=0.02)
    with pytest.raises(ValueError, match="tile"):
        RowTiledLinear(lin, tile=0)


def test_per_row_layout_gives_every_query_row_its_own_context():
    tables = torch.tensor([[5, 6, 0], [7, 8, 9]])
    layout = per_row_layout([3, 1], [5, 9], tables)
    d = layout.decode_batch
    assert layout.prefills == [] and layout.decode_buckets == [] and d.all_tokens
    assert d.context_lens.tolist() == [3, 4, 5, 9]  # a chunk's rows at positions 2, 3, 4; a decode at 8
    assert d.token_index.tolist() == [0, 1, 2, 3]
    assert d.block_tables.tolist() == [[5, 6, 0]] * 3 + [[7, 8, 9]]


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_together_and_chunked_equal_alone(tiny_models, family, dtype):
    folder = tiny_models[family][0]
    solo = LLM(str(folder), dtype=dtype, **BASE)
    expected = alone(solo, PROMPTS, greedy())
    # 8 tokens per step: prompts are chunked and their chunks share steps with other requests' decodes
    together = LLM(str(folder), dtype=dtype, max_num_batched_tokens=8, **BASE)
    assert together.engine.runner.attention_backend == "batch_invariant"
    assert outputs(together, PROMPTS, greedy()) == expected
    assert outputs(solo, PROMPTS, greedy()) == expected  # one big step of prefills, then decode rows together


@pytest.mark.parametrize("cache", [dict(kv_cache_dtype="int8"), dict(kv_cache="contiguous", num_kvcache_blocks=8)])
def test_8bit_and_contiguous_caches_chunked_equal_alone(tiny_models, cache):
    folder = tiny_models["qwen2"][0]
    kw = dict(BASE, dtype="bfloat16", **cache)
    expected = alone(LLM(str(folder), **kw), PROMPTS, greedy())
    assert outputs(LLM(str(folder), max_num_batched_tokens=8, **kw), PROMPTS, greedy()) == expected


def test_seeded_sampled_requests_together_equal_alone(tiny_models):
    folder = tiny_models["qwen2"][0]
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=7 + i, max_tokens=16, ignore_eos=True, logprobs=2)
              for i in range(len(PROMPTS))]
    llm = LLM(str(folder), dtype="bfloat16", max_num_batched_tokens=8, **BASE)
    expected = [outputs(llm, p, sp)[0] for p, sp in zip(PROMPTS, params)]
    assert outputs(llm, PROMPTS, params) == expected


def test_same_tokens_and_close_logprobs_as_the_default_mode_in_fp32(tiny_models):
    """The mode changes rounding only: greedy tokens as the default mode's, logprobs within 1e-4."""
    folder = tiny_models["qwen2"][0]
    ours = outputs(LLM(str(folder), dtype="float32", **BASE), PROMPTS, greedy())
    default = outputs(LLM(str(folder), dtype="float32", **dict(BASE, deterministic=False)), PROMPTS, greedy())
    for (tokens, logprobs, _), (ref_tokens, ref_logprobs, _) in zip(ours, default):
        assert tokens == ref_tokens
        assert logprobs == pytest.approx(ref_logprobs, abs=1e-4)


def test_speculative_verification_rows_equal_one_row_decode(tiny_models):
    folder = tiny_models["qwen2"][0]
    expected = alone(LLM(str(folder), dtype="bfloat16", **BASE), PROMPTS, greedy(24))
    spec = LLM(str(folder), dtype="bfloat16", speculative="ngram", num_speculative_tokens=3, **BASE)
    assert outputs(spec, PROMPTS, greedy(24)) == expected
    total = spec.engine.scheduler.spec_decode_stats
    assert total["accepted"] > 0, "no draft was accepted: the test does not cover verification rows"


@pytest.mark.vlm
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_image_prompts_together_and_chunked_equal_alone(tiny_models, dtype):
    from helpers import IMAGES, SMALL, conv

    folder = tiny_models["qwen2_vl"][0]
    prompts = [{"messages": conv(IMAGES / name, text=f"describe {i}"), "mm_options": SMALL}
               for i, name in enumerate(("chelsea.png", "coffee.png", "camera.png"))] + PROMPTS[:2]
    kw = dict(BASE, dtype=dtype, max_model_len=512)
    expected = alone(LLM(str(folder), **kw), prompts, greedy())
    assert outputs(LLM(str(folder), max_num_batched_tokens=32, **kw), prompts, greedy()) == expected


def test_real_smollm2_bf16_twelve_together_equal_alone():
    from atlas_vlm.default_models import default_text_model

    llm = LLM(default_text_model(), dtype="bfloat16", num_kvcache_blocks=512, max_model_len=256, deterministic=True)
    prompts = [f"Write a short story about a {w} who" for w in
               ["cat", "dog", "robot", "king", "sailor", "child", "tree", "wizard", "baker", "pilot", "river", "clock"]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    assert outputs(llm, prompts, params) == alone(llm, prompts, params)


@pytest.mark.parametrize("kwargs, match", [
    (dict(quantization="int8"), "quantized"),
    (dict(attention_backend="bucketed"), "attention_backend"),
    (dict(compile_decode=True), "compiled decode"),
])
def test_uncovered_settings_are_refused_at_load(tiny_models, kwargs, match):
    with pytest.raises(ValueError, match=f"deterministic=True cannot run here: .*{match}"):
        LLM(str(tiny_models["qwen2"][0]), dtype="float32", **BASE, **kwargs)


def test_gguf_runs_on_dense_weights():
    """Deterministic mode needs dense weights: a .gguf with no quantization named loads its dense
    copy; SmolLM2's Q4_1 rows (576 wide: no stored-block kernel) are dense copies as stored too,
    so both build with the batch-invariant linears and no stored-block layer."""
    from atlas_vlm.default_models import default_text_model
    from atlas_vlm.layers.gguf_linear import GGUFLinear

    for quantization in (None, "gguf"):
        layers = list(LLM(default_text_model(), quantization=quantization, dtype="float32", **BASE)
                      .engine.runner.model.modules())
        assert not any(isinstance(m, GGUFLinear) for m in layers)
        assert any(isinstance(m, RowTiledLinear) for m in layers)  # the batch-invariant dense linears


def test_bad_value_and_cli_flags():
    from atlas_vlm.config import EngineConfig
    from atlas_vlm.entrypoints import cli
    from atlas_vlm.entrypoints.openai.cli_args import engine_config_from_args

    with pytest.raises(ValueError, match="deterministic must be True or False, got 'yes'"):
        EngineConfig(model="m", deterministic="yes")
    assert engine_config_from_args(cli.build_parser().parse_args(["serve", "m", "--deterministic"])).deterministic
    assert not engine_config_from_args(cli.build_parser().parse_args(["serve", "m"])).deterministic
    spec = importlib.util.spec_from_file_location("generate_cli_det", REPO / "scripts" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.parse_args(["--prompt", "hi", "--deterministic"]).deterministic
    assert not module.parse_args(["--prompt", "hi"]).deterministic
