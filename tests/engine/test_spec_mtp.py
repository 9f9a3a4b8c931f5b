"""Speculative decoding with Qwen3.5's MTP head (``speculative="mtp"``), on tiny random
Qwen3.5 models: all layers full attention, and the released hybrid pattern (Gated DeltaNet
layers whose state rolls back over rejected drafts, ``StateCache.accept_rows``).

- The drafter against a plain PyTorch forward of the MTP math over whole sequences (written
  here from vLLM's ``qwen3_next_mtp.py``, HF's target hidden states, no cache): every draft
  the engine proposed, at every step (chunked prefill, drafts accepted and rejected), equals
  the reference's greedy proposals (fp32).
  After a prefix hit (its last block recomputed) too.
- Greedy output with MTP drafts equals speculation off token for token, logprobs within 1e-5,
  in a batch, with drafts accepted and rejected.
- A checkpoint without ``mtp.*`` (or a model without an MTP head) is refused by name.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import atlas_vlm.spec_decode.scheduling as scheduling
from atlas_vlm import LLM, SamplingParams
from atlas_vlm.spec_decode.mtp import MTPProposer
from qwen3_5_helpers import build_tiny_qwen3_5, random_mtp_weights, tiny_config

pytestmark = pytest.mark.text
K = 3
BASE = dict(device="cpu", dtype="float32", max_model_len=256, kvcache_block_size=4, kv_cache_memory=1 << 24)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], list(range(50, 80)), [9, 8, 7], [5] * 6]


def full_attention_config(tie: bool = False, hybrid: bool = False):
    """The tiny Qwen3.5 config: all layers full attention, or (``hybrid``) the released
    pattern of Gated DeltaNet and full-attention layers."""
    config = tiny_config()
    if not hybrid:
        config.text_config.layer_types = ["full_attention"] * config.text_config.num_hidden_layers
    config.text_config.tie_word_embeddings = config.tie_word_embeddings = tie
    return config


PATTERNS = ["full_attention", "hybrid"]


@pytest.fixture(scope="module", params=PATTERNS)
def random_mtp(tmp_path_factory, request):
    """Tiny Qwen3.5 (all full attention, or the hybrid pattern) with a random MTP head;
    returns (folder, HF model, mtp tensors)."""
    folder = tmp_path_factory.mktemp("qwen3_5_mtp")
    config = full_attention_config(hybrid=request.param == "hybrid")
    mtp = random_mtp_weights(config.text_config, seed=5)
    hf = build_tiny_qwen3_5(folder, seed=1, text_only=True, config=config, mtp=mtp)
    return folder, hf, mtp


@pytest.fixture(scope="module", params=PATTERNS)
def repeater_mtp(tmp_path_factory, request):
    """Tied embeddings and an MTP head whose ``fc`` carries the next token's embedding
    through: it mostly proposes the last token again, so on this model's repetitive greedy
    outputs drafts are both accepted and rejected."""
    folder = tmp_path_factory.mktemp("qwen3_5_mtp_repeat")
    config = full_attention_config(tie=True, hybrid=request.param == "hybrid")
    mtp = random_mtp_weights(config.text_config, seed=5)
    h = config.text_config.hidden_size
    mtp["fc.weight"][:, :h] += 3.0 * torch.eye(h)
    build_tiny_qwen3_5(folder, seed=1, text_only=True, config=config, mtp=mtp)
    return folder


@pytest.fixture
def always_draft(monkeypatch):
    """Every decode step drafts ``K`` (no acceptance floor: random drafts are rarely taken)."""
    monkeypatch.setattr(scheduling, "ACCEPTANCE_FLOOR", 0.0)


def greedy(max_tokens=20):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)


def spec_llm(folder, **kw):
    return LLM(str(folder), speculative="mtp", num_speculative_tokens=K, speculative_disable_by_batch_size=None,
               **{**BASE, **kw})


# ---- the reference: vLLM's MTP math, whole sequence, no cache ------------------------------
def _norm(x, w, eps):  # Qwen3.5's zero-centred RMSNorm (vLLM's GemmaRMSNorm)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def _rope(x, positions, rotary_dim, theta):  # partial rotary, rotate-half; text: M-RoPE is plain RoPE
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    freqs = positions.float()[:, None] * inv_freq[None]
    cos, sin = torch.cat([freqs, freqs], -1).cos()[:, None], torch.cat([freqs, freqs], -1).sin()[:, None]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], -1)
    return torch.cat([rot * cos + rotated * sin, rest], -1)


def reference_mtp(w, c, embeds, hidden, positions):
    """vLLM ``Qwen3NextMultiTokenPredictor.forward`` + one ``Qwen3NextDecoderLayer`` (full
    attention, gated), causal over the whole sequence: ``[T, hidden]`` out (after mtp.norm)."""
    eps, hd, heads, kvh = c.rms_norm_eps, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    rope = c.rope_parameters
    z = F.linear(torch.cat([_norm(embeds, w["pre_fc_norm_embedding.weight"], eps),
                            _norm(hidden, w["pre_fc_norm_hidden.weight"], eps)], -1), w["fc.weight"])
    p = "layers.0."
    x = _norm(z, w[p + "input_layernorm.weight"], eps)
    q, gate = F.linear(x, w[p + "self_attn.q_proj.weight"]).view(-1, heads, 2 * hd).chunk(2, dim=-1)
    k = F.linear(x, w[p + "self_attn.k_proj.weight"]).view(-1, kvh, hd)
    v = F.linear(x, w[p + "self_attn.v_proj.weight"]).view(-1, kvh, hd)
    rd = int(hd * rope["partial_rotary_factor"])
    q = _rope(_norm(q, w[p + "self_attn.q_norm.weight"], eps), positions, rd, rope["rope_theta"])
    k = _rope(_norm(k, w[p + "self_attn.k_norm.weight"], eps), positions, rd, rope["rope_theta"])
    k, v = k.repeat_interleave(heads // kvh, 1), v.repeat_interleave(heads // kvh, 1)
    att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    att = att.transpose(0, 1).reshape(-1, heads * hd) * torch.sigmoid(gate.reshape(-1, heads * hd))
    z = z + F.linear(att, w[p + "self_attn.o_proj.weight"])
    x = _norm(z, w[p + "post_attention_layernorm.weight"], eps)
    mlp = F.linear(F.silu(F.linear(x, w[p + "mlp.gate_proj.weight"])) * F.linear(x, w[p + "mlp.up_proj.weight"]),
                   w[p + "mlp.down_proj.weight"])
    return _norm(z + mlp, w["norm.weight"], eps)


@torch.no_grad()
def reference_drafts(hf, w, tokens: list[int], k: int) -> list[int]:
    """Greedy MTP proposals after ``tokens`` (the newest not yet through the target): the
    target's final hidden states of ``tokens[:-1]`` (HF), the MTP over positions
    ``0 .. n-2`` with tokens ``1 .. n-1``, then ``k - 1`` chained steps on its own output."""
    hidden = hf.model(torch.tensor([tokens[:-1]])).last_hidden_state[0]  # [n - 1, hidden], after the final norm
    ids, hs = list(tokens[1:]), [hidden]
    drafts = []
    for _ in range(k):
        h_in = torch.cat(hs)
        out = reference_mtp(w, hf.config, hf.model.embed_tokens(torch.tensor(ids)), h_in, torch.arange(len(ids)))
        drafts.append(int(hf.lm_head(out[-1]).argmax()))
        ids.append(drafts[-1])
        hs.append(out[-1:])
    return drafts


def test_drafts_equal_the_reference(random_mtp, always_draft):
    folder, hf, w = random_mtp
    llm = spec_llm(folder, max_num_batched_tokens=16)  # the 30-token prompt runs in chunks
    proposer = llm.engine.scheduler.proposer
    assert isinstance(proposer, MTPProposer)
    seen = []
    propose = proposer.propose

    def recording(token_ids, k, media_ranges=(), request_id=None):
        drafts = propose(token_ids, k, media_ranges, request_id)
        seen.append((list(token_ids), drafts))
        return drafts

    proposer.propose = recording
    outs = llm.generate(PROMPTS, greedy(12))
    assert sum(o.spec_decode["proposed"] for o in outs) == sum(len(d) for _, d in seen) > 40
    assert all(d for _, d in seen)  # a draft every decode step
    for tokens, drafts in seen:
        assert drafts == reference_drafts(hf, w, tokens, K)[:len(drafts)], tokens


def test_prefix_hit_drafts_equal_the_reference(random_mtp, always_draft):
    """A prompt sharing 24 tokens (6 blocks) with a finished one: its hit drops the last
    block (whose last MTP K/V were made with the first prompt's next token), and every
    draft after the hit equals the reference's; output as speculation off."""
    folder, hf, w = random_mtp
    first = list(range(100, 130))
    second = first[:24] + [7, 8, 9]
    # a state snapshot at every block (hybrid pattern; the option is unused without linear attention)
    llm = spec_llm(folder, enable_prefix_caching=True, hybrid_snapshot_interval=4)
    llm.generate([first], greedy(6))
    bm, proposer = llm.engine.block_manager, llm.engine.scheduler.proposer
    cached, seen = [], []
    allocate, propose = bm.prefill_allocate, proposer.propose

    def allocating(req):
        table = allocate(req)
        cached.append(req.num_cached_tokens)
        return table

    def recording(token_ids, k, media_ranges=(), request_id=None):
        drafts = propose(token_ids, k, media_ranges, request_id)
        seen.append((list(token_ids), drafts))
        return drafts

    bm.prefill_allocate, proposer.propose = allocating, recording
    out = llm.generate([second], greedy(10))[0]
    assert cached == [20]  # 6 blocks cached, the last one recomputed
    assert len(seen) >= 5
    for tokens, drafts in seen:
        assert drafts == reference_drafts(hf, w, tokens, K)[:len(drafts)], tokens
    assert out.token_ids == LLM(str(folder), **BASE).generate([second], greedy(10))[0].token_ids


def test_greedy_equals_speculation_off(repeater_mtp, always_draft):
    ref = LLM(str(repeater_mtp), **BASE).generate(PROMPTS, greedy(24))
    outs = spec_llm(repeater_mtp).generate(PROMPTS, greedy(24))
    proposed = sum(o.spec_decode["proposed"] for o in outs)
    accepted = sum(o.spec_decode["accepted"] for o in outs)
    assert 0 < accepted < proposed  # drafts taken and drafts rejected
    for a, b in zip(outs, ref):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_no_drafts_in_a_large_batch(repeater_mtp, always_draft):
    """With ``speculative_disable_by_batch_size=2``: four running requests draft nothing (the
    drafter makes none either), the last two draft once the others finished; output as off."""
    params = [greedy(n) for n in (4, 6, 24, 24)]
    ref = LLM(str(repeater_mtp), **BASE).generate(PROMPTS, params)
    llm = LLM(str(repeater_mtp), speculative="mtp", num_speculative_tokens=K, speculative_disable_by_batch_size=2,
              **BASE)
    stored = []
    store = llm.engine.scheduler.proposer.store
    llm.engine.scheduler.proposer.store = lambda rid, n, d: (stored.append(rid), store(rid, n, d))
    outs = llm.generate(PROMPTS, params)
    assert [o.spec_decode["drafts"] > 0 for o in outs] == [False, False, True, True]
    assert stored.count(outs[0].request_id) == 0 and stored.count(outs[1].request_id) == 0
    for a, b in zip(outs, ref):
        assert a.token_ids == b.token_ids


def test_checkpoint_without_mtp_weights_is_refused(tmp_path):
    build_tiny_qwen3_5(tmp_path, seed=2, text_only=True, config=full_attention_config())
    with pytest.raises(ValueError, match=rf"(?s){tmp_path}.*mtp\.fc\.weight"):
        LLM(str(tmp_path), speculative="mtp", **BASE)


def test_model_without_mtp_head_is_refused(tiny_models):
    folder = tiny_models["qwen2"][0]
    with pytest.raises(ValueError, match=rf"{folder}.*has none"):
        LLM(str(folder), speculative="mtp", **BASE)


def test_proposer_keeps_drafts_for_their_length():
    p = MTPProposer(placeholder_token_ids={99}, capacity=2)
    p.store("a", 3, [4, 5, 6])
    assert p.propose([1, 2, 3], 2, request_id="a") == [4, 5]
    assert p.propose([1, 2, 3, 4], 2, request_id="a") == []  # made for another length
    p.store("b", 1, [7, 99, 8])
    assert p.propose([1], 3, request_id="b") == [7]  # stops before a placeholder id
    p.store("c", 1, [1])
    assert p.propose([1, 2, 3], 2, request_id="a") == []  # the oldest dropped past capacity


def test_cli_flags_take_mtp():
    import importlib.util

    from helpers import REPO
    from atlas_vlm.entrypoints import cli
    from atlas_vlm.entrypoints.openai.cli_args import engine_config_from_args

    config = engine_config_from_args(cli.build_parser().parse_args(["serve", "m", "--speculative", "mtp"]))
    assert (config.speculative_config.method, config.speculative_config.speculative_tokens) == ("mtp", 4)
    spec = importlib.util.spec_from_file_location("generate_cli_mtp", REPO / "scripts" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.parse_args(["--speculative", "mtp", "--num-speculative-tokens", "2", "--prompt", "hi"])
    assert (args.speculative, args.num_speculative_tokens) == ("mtp", 2)


@pytest.mark.vlm
@pytest.mark.parametrize("pattern", PATTERNS)
def test_image_prompt_greedy_equals_speculation_off(tmp_path, always_draft, pattern):
    """An image prompt beside a text one (M-RoPE positions of the chained drafts: index +
    rope delta; image rows in the target's hidden states), with the prompt in chunks cut
    inside the image."""
    from helpers import IMAGES, conv
    from qwen3_5_helpers import tiny_vl_config

    config = tiny_vl_config()
    if pattern == "full_attention":
        config.text_config.layer_types = ["full_attention"] * config.text_config.num_hidden_layers
    build_tiny_qwen3_5(tmp_path, seed=21, config=config, mtp=random_mtp_weights(config.text_config, seed=2))
    convs = [conv(IMAGES / "chelsea.png", text="Describe this image."), [{"role": "user", "content": "Just text."}]]
    bounds = {"min_pixels": 16 * 32 * 32, "max_pixels": 40 * 32 * 32}
    kw = dict(max_model_len=1024, max_num_batched_tokens=16)
    ref = LLM(str(tmp_path), **{**BASE, **kw}).chat(convs, greedy(12), mm_options=bounds, use_tqdm=False)
    outs = spec_llm(tmp_path, **kw).chat(convs, greedy(12), mm_options=bounds, use_tqdm=False)
    assert sum(o.spec_decode["proposed"] for o in outs) > 0
    for a, b in zip(outs, ref):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
