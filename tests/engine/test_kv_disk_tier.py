"""The disk KV tier through the engine (``kv_cache_dir``): with a tiny block pool, a long
prompt's blocks are evicted by other prompts and found again on disk, also by a new engine
(a restart) and for an image prompt (a different image never hits); damaged files and files
of another engine's fingerprint are misses; every output equals a cold run's exactly (greedy
tokens and logprobs)."""

from __future__ import annotations

import logging
import shutil

import pytest

from helpers import IMAGES
from atlas_vlm import LLM, SamplingParams
from mm_kv_cache_management import RequestState

BS = 16
BASE = dict(max_model_len=1024, kvcache_block_size=BS, num_kvcache_blocks=16, device="cpu", dtype="float32",
            max_num_seqs=1)
SP = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
LONG = "The quick brown fox jumps over the lazy dog. " * 12  # 120 tokens: 7 full blocks before the last token
OTHERS = [f"Another prompt, number {i}, about something else entirely. " * 10 for i in range(3)]
PIX = 28 * 28


def engine(folder, kv_dir=None, **kwargs) -> LLM:
    """An LLM that records each request's cached tokens at admission in ``llm.cached``."""
    llm = LLM(str(folder), **{**BASE, **kwargs}, **({"kv_cache_dir": str(kv_dir)} if kv_dir else {}))
    llm.cached = {}
    llm.engine.runner.observers.append(
        lambda chunks, *_: llm.cached.update({r.request_id: r.num_cached_tokens for r, _ in chunks
                                              if r.request_id not in llm.cached}))
    return llm


def prompt_hashes(llm: LLM, prompt: str) -> list[bytes]:
    """Block hashes of ``prompt``'s full blocks before its last token (those a hit may cover)."""
    tokens = list(llm.engine.process_prompt(prompt).prompt_token_ids)
    return RequestState("probe", tokens).block_hashes(BS, len(tokens) - 1)


def gen(llm: LLM, prompt) -> tuple[tuple, int]:
    """``((token ids, logprobs, top logprobs), cached tokens)`` of one greedy request."""
    out = (llm.chat(prompt, SP, use_tqdm=False) if isinstance(prompt, list) else llm.generate(prompt, SP, use_tqdm=False))[0]
    return (out.token_ids, out.logprobs, out.top_logprobs), llm.cached[out.request_id]


@pytest.fixture(scope="module")
def qwen2(tiny_models):
    return tiny_models["qwen2"][0]


@pytest.fixture(scope="module")
def cold(qwen2):
    """Outputs of LONG and OTHERS[0] without any cache."""
    llm = engine(qwen2, enable_prefix_caching=False)
    return {p: gen(llm, p)[0] for p in (LONG, OTHERS[0])}


@pytest.mark.text
def test_evicted_blocks_come_back_from_disk_and_after_a_restart(qwen2, cold, tmp_path):
    llm = engine(qwen2, tmp_path)
    first, cached = gen(llm, LONG)
    assert first == cold[LONG] and cached == 0
    for p in OTHERS:
        gen(llm, p)
    bm, disk = llm.engine.block_manager, llm.engine.kv_tier.disk
    long_hashes = prompt_hashes(llm, LONG)
    assert len(long_hashes) == 7
    assert not any(h in bm._cached for h in long_hashes)  # evicted from memory
    hits_before = disk.hits
    again, cached = gen(llm, LONG)
    assert again == cold[LONG]
    assert cached == 7 * BS and disk.hits - hits_before == 7
    restarted = engine(qwen2, tmp_path)
    again, cached = gen(restarted, LONG)
    assert again == cold[LONG] and cached == 7 * BS and restarted.engine.kv_tier.disk.hits == 7
    assert gen(restarted, OTHERS[0]) == (cold[OTHERS[0]], len(prompt_hashes(llm, OTHERS[0])) * BS)
    restarted.engine.reset()  # the in-memory prefix cache is emptied; the disk tier stays
    hits_before = restarted.engine.kv_tier.disk.hits
    assert gen(restarted, LONG) == (cold[LONG], 7 * BS) and restarted.engine.kv_tier.disk.hits - hits_before == 7


@pytest.mark.text
def test_damaged_files_are_misses_and_are_rewritten(qwen2, cold, tmp_path, caplog):
    writer = engine(qwen2, tmp_path)
    gen(writer, LONG)
    hashes = prompt_hashes(writer, LONG)
    disk = writer.engine.kv_tier.disk
    flipped, truncated = disk.path(hashes[3]), disk.path(hashes[5])
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x55
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:100])
    reader = engine(qwen2, tmp_path)
    with caplog.at_level(logging.WARNING, logger="mm_kv_cache_management.disk_tier"):
        out, cached = gen(reader, LONG)
    assert out == cold[LONG] and cached == 3 * BS  # blocks 0-2 load; block 3 is damaged: the chain ends
    assert len([r for r in caplog.records if "corrupt" in r.getMessage()]) == 1
    assert flipped.is_file()  # deleted, recomputed and written again
    # block 5's file was not reached (the chain ended at 3): the next engine finds it damaged
    out, cached = gen(engine(qwen2, tmp_path), LONG)
    assert out == cold[LONG] and cached == 5 * BS
    out, cached = gen(engine(qwen2, tmp_path), LONG)  # ... and rewrote it: every block hits now
    assert out == cold[LONG] and cached == 7 * BS


@pytest.mark.text
def test_files_of_another_fingerprint_are_misses(qwen2, tmp_path):
    a = engine(qwen2, tmp_path, attention_backend="reference")
    gen(a, LONG)
    b = engine(qwen2, tmp_path, attention_backend="bucketed")
    dir_a, dir_b = a.engine.kv_tier.disk.dir, b.engine.kv_tier.disk.dir
    assert dir_a != dir_b and dir_a.parent == dir_b.parent == tmp_path
    for f in dir_a.iterdir():
        shutil.copy(f, dir_b / f.name)  # a's K/V under b's folder: same names, other fingerprint
    ref = gen(engine(qwen2, attention_backend="bucketed", enable_prefix_caching=False), LONG)[0]
    out, cached = gen(b, LONG)
    assert out == ref and cached == 0 and b.engine.kv_tier.disk.misses >= 1


@pytest.mark.text
def test_unwritable_folder_degrades_with_one_warning(qwen2, cold, tmp_path, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    with caplog.at_level(logging.WARNING, logger="mm_kv_cache_management.disk_tier"):
        llm = engine(qwen2, blocker)
        assert gen(llm, LONG)[0] == cold[LONG]
        for p in OTHERS:
            gen(llm, p)
        out, cached = gen(llm, LONG)
    assert out == cold[LONG] and cached == 0  # evicted from memory, nothing on disk: recomputed
    assert len([r for r in caplog.records if "not writable" in r.getMessage()]) == 1


@pytest.mark.text
def test_size_cap_holds_and_outputs_stay_exact(qwen2, cold, tmp_path):
    probe = engine(qwen2, tmp_path / "probe")
    gen(probe, OTHERS[0])
    block_file = max(f.stat().st_size for f in (tmp_path / "probe").rglob("*.kvb"))
    cap = 5 * block_file  # LONG alone has 7 full blocks
    llm = engine(qwen2, tmp_path / "kv", kv_cache_dir_max_bytes=cap)
    for p in (LONG, *OTHERS, LONG):
        out, _ = gen(llm, p)
        files = list((tmp_path / "kv").rglob("*.kvb"))
        assert 0 < sum(f.stat().st_size for f in files) <= cap
        if p in cold:
            assert out == cold[p]
    assert llm.engine.kv_tier.disk.bytes_stored == sum(f.stat().st_size for f in files)


@pytest.mark.text
def test_config_errors_name_the_setting(tmp_path):
    from atlas_vlm.config import EngineConfig

    with pytest.raises(ValueError, match="needs prefix caching"):
        EngineConfig(model="m", kv_cache_dir=str(tmp_path), enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_cache='paged'"):
        EngineConfig(model="m", kv_cache_dir=str(tmp_path), kv_cache="contiguous")
    with pytest.raises(ValueError, match="kv_cache_dir_max_bytes"):
        EngineConfig(model="m", kv_cache_dir=str(tmp_path), kv_cache_dir_max_bytes=0)
    with pytest.raises(ValueError, match="kv_cache_dir must be"):
        EngineConfig(model="m", kv_cache_dir=3)
    assert EngineConfig(model="m", kv_cache_dir=tmp_path).kv_cache_dir == str(tmp_path)


@pytest.mark.text
def test_serve_flags_set_the_disk_tier(tmp_path):
    from atlas_vlm.entrypoints import cli
    from atlas_vlm.entrypoints.openai.cli_args import engine_config_from_args

    parse = cli.build_parser().parse_args
    config = engine_config_from_args(parse(["serve", "m", "--kv-cache-dir", str(tmp_path), "--kv-cache-dir-max-gb",
                                            "0.5"]))
    assert (config.kv_cache_dir, config.kv_cache_dir_max_bytes) == (str(tmp_path), 1 << 29)
    assert engine_config_from_args(parse(["serve", "m"])).kv_cache_dir is None
    with pytest.raises(ValueError, match="--kv-cache-dir-max-gb"):
        engine_config_from_args(parse(["serve", "m", "--kv-cache-dir", str(tmp_path), "--kv-cache-dir-max-gb", "0"]))
    with pytest.raises(ValueError, match="needs --kv-cache-dir"):
        engine_config_from_args(parse(["serve", "m", "--kv-cache-dir-max-gb", "1"]))
    with pytest.raises(ValueError, match="prefix caching"):
        engine_config_from_args(parse(["serve", "m", "--kv-cache-dir", str(tmp_path), "--no-enable-prefix-caching"]))


def image_chat(image: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": str(IMAGES / image)},
                                         {"type": "text", "text": "Describe this picture in a few words, please."}]}]


def assert_same_output(out: tuple, ref: tuple, atol: float = 1e-5) -> None:
    """The same greedy tokens and top-logprob ids as ``ref``, logprobs within ``atol``: a prompt
    served from a prefix hit runs its suffix in a shorter prefill, and fp32 GEMMs of another row
    count may round differently in the last bits on some CPUs (seen: 1e-6 on an Intel Xeon)."""
    (ids, lps, tops), (ref_ids, ref_lps, ref_tops) = out, ref
    assert ids == ref_ids
    assert lps == pytest.approx(ref_lps, abs=atol)
    for top, ref_top in zip(tops, ref_tops, strict=True):
        assert top.keys() == ref_top.keys() and list(top.values()) == pytest.approx(list(ref_top.values()), abs=atol)


@pytest.mark.vlm
def test_image_prompt_hits_after_a_restart_and_another_image_does_not(tiny_models, tmp_path):
    folder = tiny_models["qwen2_vl"][0]
    opts = dict(max_pixels=64 * PIX)
    cold = engine(folder, enable_prefix_caching=False, **opts)
    ref_a, ref_b = gen(cold, image_chat("chelsea.png"))[0], gen(cold, image_chat("coffee.png"))[0]
    gen(engine(folder, tmp_path, **opts), image_chat("chelsea.png"))
    llm = engine(folder, tmp_path, **opts)
    p = llm.engine.process_prompt({"messages": image_chat("chelsea.png")})
    n, image = len(p.prompt_token_ids), p.image_spans[0]
    assert image.end < (n - 1) // BS * BS  # full blocks past the image: the hit covers it
    out, cached = gen(llm, image_chat("chelsea.png"))
    assert_same_output(out, ref_a)
    assert cached == (n - 1) // BS * BS
    restarted = engine(folder, tmp_path, **opts)
    out, cached = gen(restarted, image_chat("coffee.png"))  # same tokens around, other image
    assert_same_output(out, ref_b)
    assert cached <= image.offset // BS * BS


@pytest.mark.text
def test_generate_script_fills_and_reuses_the_folder(qwen2, tmp_path, capsys):
    import importlib.util

    from helpers import REPO

    spec = importlib.util.spec_from_file_location("generate_cli", REPO / "scripts" / "generate.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    args = ["--dtype", "float32", "--device", "cpu", "--model", str(qwen2), "--prompt", LONG, "--max-tokens", "6",
            "--no-chat", "--kv-cache-dir", str(tmp_path), "--kv-cache-dir-max-gb", "0.01"]
    assert cli.main(args) == 0
    first = capsys.readouterr().out
    files = sorted(tmp_path.rglob("*.kvb"))
    assert len(files) == 7  # 120 + 5 computed tokens: 7 full blocks
    assert cli.main(args) == 0
    assert capsys.readouterr().out == first
    assert sorted(tmp_path.rglob("*.kvb")) == files
    assert cli.main([*args[:-1], "0"]) == 1
    assert "--kv-cache-dir-max-gb must be > 0" in capsys.readouterr().err


@pytest.mark.text
def test_an_8bit_cache_round_trips_codes_and_scales_and_has_its_own_fingerprint(qwen2, tmp_path):
    cold = gen(engine(qwen2, kv_cache_dtype="int8", enable_prefix_caching=False), LONG)[0]
    llm = engine(qwen2, tmp_path, kv_cache_dtype="int8")
    assert gen(llm, LONG) == (cold, 0)
    restarted = engine(qwen2, tmp_path, kv_cache_dtype="int8")
    assert gen(restarted, LONG) == (cold, 7 * BS)  # codes and scales back from disk, outputs exact
    dense = engine(qwen2, tmp_path)  # another KV format: another fingerprint folder, no hit
    assert dense.engine.kv_tier.disk.dir != llm.engine.kv_tier.disk.dir
    assert gen(dense, LONG)[1] == 0


@pytest.mark.text
def test_files_of_an_older_8bit_format_are_misses_and_auto_keeps_its_folder(qwen2, tmp_path, monkeypatch):
    from atlas_vlm.worker import kv_tier_builder as kv_fingerprint

    written = engine(qwen2, tmp_path, kv_cache_dtype="int8")
    cold = gen(written, LONG)[0]
    dense_dir = engine(qwen2, tmp_path).engine.kv_tier.disk.dir
    monkeypatch.setattr(kv_fingerprint, "KV_FORMAT", "another 8-bit format")  # as a format change would
    reader = engine(qwen2, tmp_path, kv_cache_dtype="int8")
    assert reader.engine.kv_tier.disk.dir != written.engine.kv_tier.disk.dir
    assert gen(reader, LONG) == (cold, 0)  # the old files are not read
    assert engine(qwen2, tmp_path).engine.kv_tier.disk.dir == dense_dir  # auto KV: no format key
