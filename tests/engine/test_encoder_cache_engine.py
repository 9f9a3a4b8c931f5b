"""The encoder-cache manager in a real engine (tiny random Qwen3.5 VLM, fp32 CPU): two
requests with the same image in one step run the tower once and both equal HF; the rows stay
with the runner (by content hash), never in a request; a step whose tower raises leaves no
cache entry behind, and after ``reset`` the same image is encoded again and equals HF;
``reset_mm_cache`` drops what no request needs."""

from __future__ import annotations

import pytest

from atlas_vlm import LLM
from helpers import CPU_FP32, IMAGES, assert_matches_hf, chat, conv, greedy
from qwen3_5_helpers import build_tiny_qwen3_5, tiny_vl_config

pytestmark = pytest.mark.vlm

PX = 32 * 32  # pixels per visual token (patch 16, merge 2)
BOUNDS = {"min_pixels": 16 * PX, "max_pixels": 40 * PX}
N = 6


@pytest.fixture(scope="module")
def q35(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_qwen3_5_vl_encoder_cache")
    return folder, build_tiny_qwen3_5(folder, seed=23, config=tiny_vl_config())


def make_llm(folder) -> LLM:
    return LLM(str(folder), max_model_len=1024, num_kvcache_blocks=256, kvcache_block_size=16, max_num_seqs=4,
               **CPU_FP32)


def test_a_shared_image_in_one_step_is_encoded_once(q35):
    folder, hf = q35
    llm = make_llm(folder)
    convs = [conv(IMAGES / "chelsea.png", text="Describe this image."),
             conv(IMAGES / "chelsea.png", text="What colour is the cat?")]
    outs, rec = chat(llm, convs, N, BOUNDS)
    for c, out in zip(convs, outs):
        assert_matches_hf(llm, hf, c, out, rec, N, BOUNDS)
    first_steps = [rec.by_request[o.request_id][0]["step"] for o in outs]
    assert first_steps[0] == first_steps[1]  # both prompts in the same step
    runner, manager = llm.engine.runner, llm.engine.scheduler.encoder_cache
    assert runner.num_encoder_runs == 1
    (content_hash,) = runner.encoder_outputs
    assert manager.is_cached(content_hash) and manager.num_refs(content_hash) == 0  # kept, unreferenced
    assert not hasattr(rec.by_request[outs[0].request_id][0]["req"], "mm_embeds")
    llm.reset_mm_cache()
    assert not runner.encoder_outputs and len(manager) == 0


def test_a_tower_fault_leaves_no_cache_entry(q35):
    folder, hf = q35
    llm = make_llm(folder)
    runner = llm.engine.runner
    encode = runner.vision.encode

    def broken(items):
        raise RuntimeError("injected tower fault")

    runner.vision.encode = broken
    c = conv(IMAGES / "chelsea.png", text="Describe this image.")
    with pytest.raises(RuntimeError, match="injected tower fault"):
        llm.chat([c], greedy(N), mm_options=BOUNDS, use_tqdm=False)
    assert len(llm.engine.scheduler.encoder_cache) == 0 and not runner.encoder_outputs
    llm.engine.reset()
    runner.vision.encode = encode
    (out,), rec = chat(llm, [c], N, BOUNDS)
    assert_matches_hf(llm, hf, c, out, rec, N, BOUNDS)
    assert runner.num_encoder_runs == 1
