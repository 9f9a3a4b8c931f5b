"""The engine plan without a model: every row of the exclusion table refuses with the message
users get, every missing capability is refused or planned around, the choices carry their
reasons, and the assembly constructors stay short (``engine.plan``, ``engine.plan_rules``)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

import pytest
import torch

from atlas_vlm.config import EngineConfig
from atlas_vlm.engine.engine import LLMEngine
from atlas_vlm.engine.plan import KVBudgetError, plan_engine
from atlas_vlm.engine.plan_rules import RULES, Environment, PlanContext
from atlas_vlm.models.arch import ModelArch
from atlas_vlm.models.interfaces import ModelCapabilities
from atlas_vlm.worker.model_runner import ModelRunner
from mm_kv_cache_management import StateSpec

pytestmark = pytest.mark.text

ARCH = ModelArch(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                 num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, qkv_bias=False, o_bias=False, mlp_bias=False,
                 hidden_act="silu", tie_word_embeddings=False, max_position_embeddings=512, mrope_section=None)
STATE = StateSpec(num_layers=3, conv_dim=8, conv_kernel=4, num_v_heads=2, k_head_dim=4, v_head_dim=4)
DENSE = ModelCapabilities("ToyLM", num_layers=4, num_kv_layers=4)
HYBRID = ModelCapabilities("HybridLM", num_layers=4, num_kv_layers=1, state_spec=STATE, state_snapshots=True,
                           state_rollback=True, mtp=True)
CPU = Environment(torch.device("cpu"), torch.float32, ARCH, budget_bytes=1 << 20, max_model_len=256)


def cfg(**kw) -> EngineConfig:
    return EngineConfig(model="toy", **kw)


def env(**kw) -> Environment:
    return dataclasses.replace(CPU, **kw)


def caps(base=DENSE, **kw) -> ModelCapabilities:
    return dataclasses.replace(base, **kw)


# rule name -> (config, capabilities, environment, a piece of the message users get)
CASES = {
    "decode_kernel_cannot_serve": (cfg(attention_backend="decode_kernel"), DENSE, env(decode_kernel_reason="no cc"),
                                   "attention_backend='decode_kernel' cannot serve this model: no cc"),
    "triton_cannot_serve": (cfg(attention_backend="triton"), DENSE, env(triton_reason="triton does not import"),
                            "attention_backend='triton' cannot serve this model: triton does not import"),
    "deterministic_hybrid": (cfg(deterministic=True), HYBRID, CPU,
                             "deterministic=True does not serve hybrid models (HybridLM"),
    "deterministic_settings": (cfg(deterministic=True), DENSE, env(quantized=True),
                               "deterministic=True cannot run here: quantized linears"),
    "deterministic_decode_kernel": (cfg(deterministic=True), DENSE, env(decode_kernel_reason="no cc"),
                                    "deterministic=True cannot run here: no cc"),
    "mtp_without_head": (cfg(speculative="mtp"), caps(HYBRID, mtp=False), CPU,
                         "speculative='mtp' needs a model with a multi-token-prediction head"),
    "speculative_hybrid_no_rollback": (cfg(speculative="ngram"), caps(HYBRID, state_rollback=False), CPU,
                                       "speculative='ngram' cannot run HybridLM, a hybrid model"),
    # every drafter today is tested on hybrids: the row is checked with the list narrowed (below)
    "speculative_hybrid_untested": (cfg(speculative="ngram"), HYBRID, CPU,
                                    "speculative='ngram' is not tested on hybrid models such as HybridLM"),
    "kv_cache_dir_hybrid_without_snapshots": (cfg(kv_cache_dir="/tmp/x", max_state_snapshots=0), HYBRID, CPU,
                                              "kv_cache_dir needs prefix caching, which HybridLM"),
    "kv_cache_dir_mtp": (cfg(speculative="mtp", kv_cache_dir="/tmp/x"), HYBRID, CPU,
                         "kv_cache_dir cannot serve speculative='mtp'"),
    "lora_unsupported_model": (cfg(enable_lora=True), HYBRID, CPU, "enable_lora=True cannot serve HybridLM yet"),
    "lora_deterministic": (cfg(enable_lora=True, deterministic=True), caps(lora=True), CPU,
                           "enable_lora=True cannot run with deterministic=True"),
    "lora_mtp": (cfg(enable_lora=True, speculative="mtp"), caps(HYBRID, lora=True), CPU,
                 "enable_lora=True cannot run with speculative='mtp'"),
}


def test_every_rule_has_a_case():
    assert sorted(CASES) == sorted(r.name for r in RULES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_rule_refuses_with_its_message(name, monkeypatch):
    config, capabilities, environment, message = CASES[name]
    if name == "speculative_hybrid_untested":
        monkeypatch.setattr("atlas_vlm.engine.plan_rules.HYBRID_SPECULATIVE", ("mtp",))
    with pytest.raises(ValueError) as err:
        plan_engine(config, capabilities, environment)
    assert message in str(err.value)
    ctx = PlanContext(config, capabilities, environment)  # exactly this row holds: each case isolates its rule
    assert [r.name for r in RULES if r.when(ctx)] == [name]


def test_missing_capabilities_are_planned_around():
    p = plan_engine(cfg(), caps(HYBRID, state_snapshots=False), CPU)  # no snapshots: prefix caching off
    assert p.prefix_caching.value is False and p.state_snapshots.value == 0
    assert "recurrent state" in p.prefix_caching.reason
    assert p.executors == ("eager",) and not p.compile_decode.value and not p.decode_step.value
    p = plan_engine(cfg(), HYBRID, CPU)  # with them: on, slots + snapshots off the budget
    assert p.prefix_caching.value and p.state_snapshots.value == 16 and p.state_slots == 64
    assert dict(p.kv.layer_groups) == {"attention": 1}


def test_plain_dense_plan_and_reasons():
    p = plan_engine(cfg(), DENSE, CPU)
    assert p.attention_backend.value == "decode_kernel" and p.prefix_caching.value
    assert p.executors == ("decode_step", "eager") and p.kv_tiers == ("memory",)
    assert p.num_blocks.value == (1 << 20) // (2 * 4 * 2 * 8 * 4 * 16)  # K+V x layers x heads x dim x fp32 x block
    assert set(p.reasons) >= {"attention_backend", "num_blocks", "prefix_caching", "compile_decode", "drafter"}
    assert plan_engine(cfg(), DENSE, env(decode_kernel_reason="no cc")).attention_backend.value == "bucketed"
    assert plan_engine(cfg(deterministic=True), DENSE, CPU).attention_backend.value == "batch_invariant"
    cuda = env(device=torch.device("cuda"), triton_reason=None)  # auto on CUDA: Triton where it serves
    assert plan_engine(cfg(), DENSE, cuda).attention_backend.value == "triton"
    assert plan_engine(cfg(), DENSE, env(device=torch.device("cuda"), triton_reason="no triton",
                                         decode_kernel_reason="CPU only")).attention_backend.value == "bucketed"
    assert plan_engine(cfg(), DENSE, env(triton_reason=None)).attention_backend.value == "decode_kernel"  # CPU
    assert plan_engine(cfg(attention_backend="triton"), DENSE, env(triton_reason=None)).attention_backend.value \
        == "triton"
    mtp = plan_engine(cfg(speculative="mtp"), HYBRID, CPU)
    assert dict(mtp.kv.layer_groups) == {"attention": 1, "mtp": 1} and mtp.drop_last_hit_block
    assert plan_engine(cfg(kv_cache_dir="/tmp/x"), DENSE, CPU).kv_tiers == ("memory", "disk")
    assert plan_engine(cfg(enable_chunked_prefill=False), DENSE, CPU).scheduler.max_num_batched_tokens == 2048


def test_budget_refusals():
    with pytest.raises(KVBudgetError, match="cannot hold the state slots"):
        plan_engine(cfg(), HYBRID, env(budget_bytes=1000))
    with pytest.raises(KVBudgetError, match="too small for one block of 16 tokens"):
        plan_engine(cfg(), DENSE, env(budget_bytes=100))


def test_declared_num_kv_layers_is_checked():
    with pytest.raises(ValueError, match="num_kv_layers must be an int in 1..4"):
        ModelCapabilities("Bad", num_layers=4, num_kv_layers=5)


def _body_lines(fn) -> int:
    node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    body = node.body[1:] if isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant) \
        else node.body  # without the docstring
    return body[-1].end_lineno - body[0].lineno + 1


def test_constructors_stay_short():
    assert _body_lines(ModelRunner.__init__) <= 40
    assert _body_lines(LLMEngine.__init__) <= 40
    assert _body_lines(inspect.unwrap(LLMEngine.reset)) <= 10


def test_engine_plan_stats_and_reset(tiny_models):
    """A built engine keeps its plan; ``stats()`` is what the scheduler and block manager say;
    ``reset`` builds them again from the same plan, totals carried on."""
    from atlas_vlm import LLM, SamplingParams

    llm = LLM(str(tiny_models["qwen2"][0]), dtype="float32", max_model_len=128, num_kvcache_blocks=24,
              max_num_seqs=2)
    engine = llm.engine
    assert engine.plan.num_blocks.value == 24 and engine.plan.scheduler.max_num_seqs == 2
    assert engine.plan.reasons["num_blocks"] == "num_kvcache_blocks"
    llm.generate(["one two three"] * 3, SamplingParams(max_tokens=3, ignore_eos=True))
    s = engine.stats()
    assert (s.num_running, s.num_waiting, s.num_blocks) == (0, 0, 24)
    assert s.num_free_blocks == engine.block_manager.num_free_blocks
    engine.scheduler.num_preemptions = 5  # a running total the rebuilt scheduler keeps
    old = engine.block_manager
    engine.reset()
    assert engine.block_manager is not old and engine.input_processor.block_manager is engine.block_manager
    assert engine.stats().num_preemptions == 5 and engine.stats().num_free_blocks == 24
    assert engine.scheduler.limits == engine.plan.scheduler
