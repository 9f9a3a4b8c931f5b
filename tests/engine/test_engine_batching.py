"""The engine with many requests at once: batched runs equal one-at-a-time runs with chunked
prefill, preemption and prefix caching each on and off, for text and image requests mixed;
handed cases C11-C14; random add / step / abort sequences under a small block budget."""

from __future__ import annotations


import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import IMAGES
from helpers import StepRecorder
from atlas_vlm import LLM, SamplingParams

PIX = 28 * 28
GREEDY = dict(temperature=0, ignore_eos=True)


def conv(image: str | None, text: str) -> list[dict]:
    content = [{"type": "text", "text": text}]
    if image:
        content.insert(0, {"type": "image", "image": str(IMAGES / image)})
    return [{"role": "user", "content": content}]


def make_llm(folder, **kwargs):
    base = dict(max_model_len=1024, kvcache_block_size=16, num_kvcache_blocks=256, device="cpu", dtype="float32")
    return LLM(str(folder), **{**base, **kwargs})


# A mix of text-only and image requests of different lengths and output lengths.
MIX = [
    ({"messages": conv("chelsea.png", "Describe the cat.")}, 12),
    ({"prompt": "The quick brown fox jumps over the lazy dog. " * 3}, 20),
    ({"messages": conv("coffee.png", "What is in the cup?")}, 8),
    ({"prompt": "Hello"}, 16),
    ({"messages": conv("camera.png", "Who holds the camera?")}, 10),
]
MM = {"max_pixels": 64 * PIX}


def with_mm(prompt):
    return {**prompt, "mm_options": MM} if "messages" in prompt else prompt


def run(llm, prompts_and_lens):
    with StepRecorder(llm) as rec:
        prompts = [with_mm(p) for p, _ in prompts_and_lens]
        params = [SamplingParams(max_tokens=n, **GREEDY) for _, n in prompts_and_lens]
        outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, [rec.logits[o.request_id] for o in outs], rec.steps


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_vl"])
def vl_folder(tiny_models, request):
    return tiny_models[request.param][0]


@pytest.fixture(scope="module")
def alone(vl_folder):
    """Each request of MIX run by itself (no chunking, no prefix caching, ample blocks)."""
    llm = make_llm(vl_folder, enable_chunked_prefill=False, enable_prefix_caching=False)
    return [run(llm, [item]) for item in MIX]


@pytest.mark.vlm
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("blocks", [256, 12])  # 12 blocks of 16 force preemption
def test_batched_equals_alone(vl_folder, alone, chunked, prefix, blocks):
    llm = make_llm(vl_folder, enable_chunked_prefill=chunked, enable_prefix_caching=prefix,
                   num_kvcache_blocks=blocks, max_num_batched_tokens=48 if chunked else 2048)
    start_free = llm.engine.block_manager.num_free_blocks
    outs, logits, steps = run(llm, MIX + MIX[:2])  # repeat two prompts: prefix-cache hits
    expected = alone + alone[:2]
    for out, rows, (ref_outs, ref_rows, _) in zip(outs, logits, expected):
        assert out.finish_reason == "length"
        assert out.token_ids == ref_outs[0].token_ids
        assert len(rows) == len(ref_rows[0])
        for a, b in zip(rows, ref_rows[0]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert max(len(s) for s in steps) > 1, "requests never ran together"
    if chunked:
        assert any(n < 48 and start > 0 for s in steps for _, start, n, _ in s), "no prompt was split"
    if blocks == 12:
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == start_free


@pytest.mark.text
def test_c11_full_prefix_hit_recomputes_last_token(tiny_models):
    llm = make_llm(tiny_models["qwen2"][0], enable_prefix_caching=True)
    engine, bm = llm.engine, llm.engine.block_manager
    prompt = list(range(1000, 1032))  # exactly 2 * block_size
    params = SamplingParams(max_tokens=6, **GREEDY)
    a = engine.add_request(prompt, params)
    engine.step()  # A's prefill: its full blocks are now cached
    req_a = engine.requests[a]
    b = engine.add_request(prompt, params)
    req_b = engine.requests[b]
    with StepRecorder(llm) as rec:
        engine.step()
    first_block = req_a.block_table.block_ids[0]
    assert req_b.block_table.block_ids[0] == first_block
    assert bm.blocks[first_block].ref_count == 2
    assert req_b.num_cached_tokens == 16
    assert (b, 16, 16) in [c[:3] for c in rec.steps[0]]  # computed tokens 16..31, including the last prompt token
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    assert outs[a].token_ids == outs[b].token_ids
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.vlm
def test_c12_different_images_never_share_blocks(vl_folder):
    text = "Describe this picture in detail please."
    cached = make_llm(vl_folder, enable_prefix_caching=True)
    first, _, _ = run(cached, [({"messages": conv("chelsea.png", text)}, 8)])
    bm = cached.engine.block_manager
    cached_hashes = {b.block_hash for b in bm.blocks if b.block_hash is not None}
    with StepRecorder(cached) as rec:
        second = cached.chat(conv("coffee.png", text), SamplingParams(max_tokens=8, **GREEDY), mm_options=MM)
    plain = make_llm(vl_folder, enable_prefix_caching=False)
    ref = plain.chat(conv("coffee.png", text), SamplingParams(max_tokens=8, **GREEDY), mm_options=MM)
    assert second[0].token_ids == ref[0].token_ids
    # The shared text prefix before the image (system prompt) may hit; no block at or after
    # the image's first pad token may: the first step starts at or before the image.
    p = cached.engine.process_prompt({"messages": conv("coffee.png", text), "mm_options": MM})
    first_step_start = rec.steps[0][0][1]
    assert first_step_start <= p.image_spans[0].offset - p.image_spans[0].offset % 16
    assert cached_hashes  # the first run did register blocks
    assert first[0].token_ids  # and generated


@pytest.mark.vlm
def test_c13_chunk_boundary_inside_image(vl_folder):
    messages = conv("chelsea.png", "What animal is this?")
    messages[0]["content"].reverse()  # text first, then the image
    item = ({"messages": messages}, 10)
    ref_outs, ref_logits, _ = run(make_llm(vl_folder, enable_chunked_prefill=False, enable_prefix_caching=False), [item])
    llm = make_llm(vl_folder, enable_chunked_prefill=True, max_num_batched_tokens=32, enable_prefix_caching=False)
    outs, logits, steps = run(llm, [item])
    span = llm.engine.process_prompt(with_mm(item[0])).image_spans[0]
    boundaries = [start for s in steps for _, start, _, _ in s]
    assert any(span.offset < b < span.offset + span.length for b in boundaries), (span, boundaries)
    assert outs[0].token_ids == ref_outs[0].token_ids
    for a, b in zip(logits[0], ref_logits[0]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.text
def test_c14_preemption_all_finish(tiny_models):
    folder = tiny_models["qwen2"][0]
    prompts = [list(range(100 + 7 * i, 140 + 9 * i)) for i in range(8)]
    params = SamplingParams(max_tokens=24, **GREEDY)
    ample = make_llm(folder, num_kvcache_blocks=256).generate(prompts, params, use_tqdm=False)
    tight = make_llm(folder, num_kvcache_blocks=15)  # about 3 requests' worth (~5 blocks each)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ample]
    assert all(o.finish_reason == "length" for o in outs)
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.block_manager.num_free_blocks == 15


@pytest.fixture(scope="module")
def small_engine(tiny_models):
    return make_llm(tiny_models["qwen2"][0], num_kvcache_blocks=10, kvcache_block_size=4, max_model_len=40,
                    max_num_batched_tokens=16).engine


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 8)),
        st.tuples(st.just("step"), st.integers(1, 3), st.just(0)),
        st.tuples(st.just("abort"), st.integers(0, 20), st.just(0)),
    ),
    min_size=1, max_size=25,
)


@pytest.mark.text
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_random_add_step_abort(small_engine, ops):
    engine = small_engine
    bm = engine.block_manager
    start_free = bm.num_free_blocks
    added, ended = [], set()
    for op, a, b in ops:
        if op == "add":
            added.append(engine.add_request(list(range(200, 200 + a)), SamplingParams(max_tokens=b, **GREEDY)))
        elif op == "step":
            for _ in range(a):
                ended |= {o.request_id for o in engine.step() if o.finished}
        elif added:
            rid = added[a % len(added)]
            if engine.abort_request(rid) is not None:
                ended.add(rid)
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        ended |= {o.request_id for o in engine.step() if o.finished}
    assert not engine.has_unfinished_requests()
    assert set(added) == ended
    assert bm.num_free_blocks == start_free
    assert all(b.ref_count == 0 for b in bm.blocks)
