"""The disk KV tier (``kv_cache_dir``) with a hybrid model (a tiny random Qwen3.5, fp32):
its state snapshots travel with their blocks (``<hash>.kvs`` beside ``<hash>.kvb``), so a
second engine on the same folder (a restart) resumes a shared prefix from disk at a snapshot
boundary, for a text and an image prompt, with the same greedy tokens and logprobs (and
logits within 1e-5) as the cache off; a snapshot file deleted or damaged is a miss (the hit
falls back to the last boundary with one, the rest is recomputed and the file written again);
the byte cap counts snapshot files."""

from __future__ import annotations

import random

import pytest
import torch

from atlas_vlm import LLM, SamplingParams
from helpers import CPU_FP32, IMAGES, conv
from mm_kv_cache_management import RequestState
from mm_kv_cache_management.disk_tier import SNAPSHOT_SUFFIX, SUFFIX
from qwen3_5_helpers import VOCAB, build_tiny_qwen3_5, record_cached_and_logits, tiny_vl_config

INTERVAL, MAX_TOKENS, ATOL = 16, 6, 1e-5
rng = random.Random(5)
PREFIX = [rng.randrange(VOCAB) for _ in range(32)]  # two snapshot intervals
A = PREFIX + [rng.randrange(VOCAB) for _ in range(9)]
B = PREFIX + [rng.randrange(VOCAB) for _ in range(6)]  # shares 32 tokens with A: a snapshot boundary
SP = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=3, ignore_eos=True)


def make_llm(folder, kv_dir=None, **kwargs) -> LLM:
    """An LLM recording each request's cached tokens at its first row and its sampled logits."""
    base = dict(max_model_len=256, kvcache_block_size=4, max_num_seqs=2, num_kvcache_blocks=64,
                hybrid_snapshot_interval=INTERVAL, max_state_snapshots=8, **CPU_FP32)
    if kv_dir is not None:
        base["kv_cache_dir"] = str(kv_dir)
    return record_cached_and_logits(LLM(str(folder), **{**base, **kwargs}))


def run(llm, prompt):
    """``(tokens, logprobs, logits [MAX_TOKENS, vocab], cached tokens)`` of one greedy request."""
    out = (llm.chat(prompt, SP, mm_options=BOUNDS, use_tqdm=False) if isinstance(prompt[0], dict)
           else llm.generate({"prompt_token_ids": prompt}, SP, use_tqdm=False))[0]
    cached, logits = llm.seen[out.request_id]
    return out.token_ids, out.logprobs, torch.stack(logits), cached


def assert_same(result, ref):
    tokens, logprobs, logits, _ = result
    assert tokens == ref[0]
    assert max(abs(a - b) for a, b in zip(logprobs, ref[1])) < ATOL
    assert (logits - ref[2]).abs().max().item() < ATOL


def snapshot_path(llm, tokens, end):
    """The snapshot file of the block of ``tokens`` ending at token ``end``."""
    return llm.engine.kv_tier.disk.path(RequestState("probe", tokens).block_hashes(4, end)[-1], SNAPSHOT_SUFFIX)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("q35_disk") / "text"
    build_tiny_qwen3_5(folder, text_only=True)
    return folder


@pytest.fixture(scope="module")
def cold(folder):
    llm = make_llm(folder, enable_prefix_caching=False)
    return {tuple(p): run(llm, p) for p in (A, B)}


@pytest.mark.text
def test_a_restart_resumes_from_disk_at_a_snapshot(folder, cold, tmp_path):
    writer = make_llm(folder, tmp_path)
    first = run(writer, A)
    assert_same(first, cold[tuple(A)])
    assert first[3] == 0
    disk = writer.engine.kv_tier.disk
    assert snapshot_path(writer, A, 16).is_file() and snapshot_path(writer, A, 32).is_file()
    assert len(list(disk.dir.glob("*" + SNAPSHOT_SUFFIX))) == 2  # one per interval, none between
    restarted = make_llm(folder, tmp_path)
    second = run(restarted, B)
    assert_same(second, cold[tuple(B)])
    assert second[3] == 32  # 8 blocks and the snapshot at 32, all from disk
    pool = restarted.engine.block_manager.state_snapshots
    assert (pool.hits, pool.queries) == (1, 1) and restarted.engine.kv_tier.disk.hits == 9  # 8 blocks + 1 snapshot


@pytest.mark.text
def test_a_missing_or_damaged_snapshot_is_a_miss(folder, cold, tmp_path):
    writer = make_llm(folder, tmp_path)
    run(writer, A)
    at16, at32 = snapshot_path(writer, A, 16), snapshot_path(writer, A, 32)
    data = bytearray(at32.read_bytes())
    data[len(data) // 2] ^= 0x55
    at32.write_bytes(bytes(data))
    result = run(make_llm(folder, tmp_path), B)
    assert_same(result, cold[tuple(B)])
    assert result[3] == 16  # the damaged snapshot at 32 is a miss: the hit ends at 16
    assert at32.is_file()  # deleted, recomputed and written again
    assert run(make_llm(folder, tmp_path), B)[3] == 32
    at16.unlink()
    at32.unlink()
    result = run(make_llm(folder, tmp_path), B)
    assert_same(result, cold[tuple(B)])
    assert result[3] == 0  # every block file is there, but no snapshot: nothing to resume from


@pytest.mark.text
def test_the_byte_cap_counts_snapshot_files(folder, cold, tmp_path):
    writer = make_llm(folder, tmp_path)
    run(writer, A)
    disk = writer.engine.kv_tier.disk
    blocks, snaps = list(disk.dir.glob("*" + SUFFIX)), list(disk.dir.glob("*" + SNAPSHOT_SUFFIX))
    snap_bytes = sum(p.stat().st_size for p in snaps)
    assert len(snaps) == 2 and snap_bytes > 0
    assert disk.bytes_stored == sum(p.stat().st_size for p in blocks) + snap_bytes
    cap = disk.bytes_stored - 1  # one byte less than A's files: writing them again must evict
    capped = make_llm(folder, tmp_path / "capped", kv_cache_dir_max_bytes=cap)
    run(capped, A)
    on_disk = sum(p.stat().st_size for p in capped.engine.kv_tier.disk.dir.iterdir())
    assert on_disk <= cap and capped.engine.kv_tier.disk.bytes_stored == on_disk
    assert_same(run(make_llm(folder, tmp_path / "capped", kv_cache_dir_max_bytes=cap), B), cold[tuple(B)])


# ---- an image prompt ------------------------------------------------------------------------
PX = 32 * 32  # pixels per visual token (patch 16, merge 2)
BOUNDS = {"min_pixels": 16 * PX, "max_pixels": 40 * PX}
SYSTEM = "You are a careful assistant for a museum archive; cite the catalogue entry."
SHARED = ("Follow the archive's conventions described above and keep the answer short, factual and in plain "
          "English, with no lists and no speculation beyond what the picture shows. ")


def image_prompt(question):
    return [{"role": "system", "content": SYSTEM}] + conv(IMAGES / "chelsea.png", text=SHARED + question)


@pytest.mark.vlm
def test_an_image_prompt_resumes_from_disk_after_a_restart(tmp_path_factory, tmp_path):
    folder = tmp_path_factory.mktemp("q35_disk_vl")
    build_tiny_qwen3_5(folder, seed=21, config=tiny_vl_config())
    kw = dict(max_model_len=1024, num_kvcache_blocks=256, kvcache_block_size=16, hybrid_snapshot_interval=32)
    first_q, second_q = image_prompt("Describe this image."), image_prompt("What colour is the cat?")
    off = make_llm(folder, enable_prefix_caching=False, **kw)
    ref = run(off, second_q)
    run(make_llm(folder, tmp_path, **kw), first_q)
    restarted = make_llm(folder, tmp_path, **kw)
    runs = restarted.engine.runner.num_encoder_runs
    result = run(restarted, second_q)
    assert_same(result, ref)
    assert result[3] > 0 and result[3] % 32 == 0
    assert restarted.engine.runner.num_encoder_runs == runs  # the image's tokens all came from disk


@pytest.mark.text
def test_mtp_with_kv_cache_dir_is_still_refused_on_a_hybrid(tmp_path):
    """A disk hit's last block would hold MTP K/V made with another request's next token
    (``_check_mtp``): that refusal is separate from the snapshots and stays."""
    from qwen3_5_helpers import random_mtp_weights, tiny_config

    config = tiny_config()
    build_tiny_qwen3_5(tmp_path / "m", seed=1, text_only=True, config=config,
                       mtp=random_mtp_weights(config.text_config, seed=5))
    with pytest.raises(ValueError, match="kv_cache_dir cannot serve speculative='mtp'"):
        make_llm(tmp_path / "m", tmp_path / "kv", speculative="mtp", num_speculative_tokens=2)


@pytest.mark.text
def test_edited_gated_deltanet_weights_get_another_folder(folder, tmp_path):
    """The Gated DeltaNet weights are part of the model identity: after one linear-attention
    tensor of the checkpoint is edited in place (same path, same size), the engine writes and
    reads another folder, so the old blocks and snapshots are not served."""
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(folder, model)
    writer = make_llm(model, tmp_path / "kv")
    run(writer, A)
    old_dir = writer.engine.kv_tier.disk.dir
    path = model / "model.safetensors"
    tensors = load_file(str(path))
    (name,) = [n for n in tensors if "layers.0.linear_attn.A_log" in n]
    tensors[name] = tensors[name] + 0.5
    size = path.stat().st_size
    save_file(tensors, str(path), metadata={"format": "pt"})
    assert path.stat().st_size == size
    llm = make_llm(model, tmp_path / "kv")
    assert llm.engine.kv_tier.disk.dir != old_dir
    result = run(llm, B)
    assert result[3] == 0
    assert_same(result, run(make_llm(model, enable_prefix_caching=False), B))


@pytest.mark.text
def test_the_fingerprint_covers_the_state_layout(folder):
    from types import SimpleNamespace

    from atlas_vlm.worker.kv_tier_builder import engine_fingerprint

    llm = make_llm(folder, enable_prefix_caching=False)
    runner, cfg = llm.engine.runner, llm.engine.hf_config
    base = engine_fingerprint(folder, cfg, runner, None)
    state = runner.state_cache
    other_spec = SimpleNamespace(spec=state.spec.__class__(**{**{f: getattr(state.spec, f) for f in (
        "num_layers", "conv_dim", "conv_kernel", "num_v_heads", "k_head_dim")}, "v_head_dim": state.spec.v_head_dim * 2}),
        conv=state.conv)
    fake = SimpleNamespace(**{k: getattr(runner, k) for k in ("kv_cache", "model", "dtype", "block_size", "device",
                                                              "attention_backend")})
    assert engine_fingerprint(folder, cfg, SimpleNamespace(**vars(fake), state_cache=state), None) == base
    assert engine_fingerprint(folder, cfg, SimpleNamespace(**vars(fake), state_cache=other_spec), None) != base
    assert engine_fingerprint(folder, cfg, SimpleNamespace(**vars(fake), state_cache=None), None) != base


@pytest.mark.text
def test_kv_cache_dir_without_a_snapshot_pool_is_refused(folder, tmp_path):
    with pytest.raises(ValueError, match="kv_cache_dir needs prefix caching.*max_state_snapshots >= 1"):
        make_llm(folder, tmp_path, max_state_snapshots=0)
