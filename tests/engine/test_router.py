"""Outputs reach their caller whatever iterator or thread stepped the engine (issue 7,
examples 2, 7 and 8): two live streams in one thread, a stream and a ``generate`` in two
threads, two threads calling ``generate`` / ``chat``, and aborts from inside a stream loop
or from another thread. Every case runs in a thread joined with a timeout (a hang fails)
and gives the same tokens as each request alone."""

from __future__ import annotations

import threading

import pytest

from atlas_vlm import LLM, SamplingParams

pytestmark = pytest.mark.text

PROMPTS = ["Once upon a time,", "The capital of France is", "def fibonacci(n):", "Hello"]
LIMIT_S = 300  # generous: a hang, not slowness, is what fails


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["qwen2"][0]), max_model_len=256, num_kvcache_blocks=64, dtype="float32")


@pytest.fixture(scope="module")
def alone(llm):
    """Greedy tokens of each prompt run by itself, for 8 and 4 new tokens."""
    return {(p, n): llm.generate(p, greedy(n), use_tqdm=False)[0].token_ids for p in PROMPTS for n in (4, 8)}


def bounded(*fns):
    """Run each ``fn`` in its own thread; all must finish within LIMIT_S. Returns results."""
    results, errors = [None] * len(fns), []

    def target(i, fn):
        try:
            results[i] = fn()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=target, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(LIMIT_S)
    assert not any(t.is_alive() for t in threads), "a call hung"
    assert not errors, errors
    return results


def assert_all_free(llm):
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.requests
    assert not llm.engine.scheduler.has_unfinished()


def joined(chunks):
    return sum((c.new_token_ids for c in chunks), []), "".join(c.new_text for c in chunks)


def test_two_live_streams_in_one_thread(llm, alone):
    def both():
        it1 = llm.generate(PROMPTS[0], greedy(8), stream=True)
        it2 = llm.generate(PROMPTS[1], greedy(4), stream=True)
        return list(it1), list(it2)

    (s1, s2), = bounded(both)
    for chunks, prompt, n in ((s1, PROMPTS[0], 8), (s2, PROMPTS[1], 4)):
        ids, text = joined(chunks)
        assert ids == alone[(prompt, n)] == chunks[-1].token_ids
        assert text == chunks[-1].text and chunks[-1].finish_reason == "length"
        assert len({c.request_id for c in chunks}) == 1
    assert_all_free(llm)


def test_interleaved_streams_in_one_thread(llm, alone):
    def interleaved():
        its = [llm.generate(p, greedy(8), stream=True) for p in PROMPTS[:3]]
        got = [[] for _ in its]
        live = set(range(len(its)))
        while live:
            for i in sorted(live):
                try:
                    got[i].append(next(its[i]))
                except StopIteration:
                    live.discard(i)
        return got

    got, = bounded(interleaved)
    for chunks, prompt in zip(got, PROMPTS[:3], strict=True):
        assert joined(chunks)[0] == alone[(prompt, 8)]
    assert_all_free(llm)


def test_threads_calling_generate_and_chat(llm, alone):
    barrier = threading.Barrier(3, timeout=LIMIT_S)

    def gen(prompts, n):
        def call():
            barrier.wait()
            return [o.token_ids for o in llm.generate(prompts, greedy(n), use_tqdm=False)]
        return call

    def chat():
        barrier.wait()
        return llm.chat([{"role": "user", "content": "Hi"}], greedy(6), use_tqdm=False)[0].token_ids

    chat_alone = llm.chat([{"role": "user", "content": "Hi"}], greedy(6), use_tqdm=False)[0].token_ids
    a, b, c = bounded(gen(PROMPTS[:2], 8), gen(PROMPTS[2:], 4), chat)
    assert a == [alone[(p, 8)] for p in PROMPTS[:2]]
    assert b == [alone[(p, 4)] for p in PROMPTS[2:]]
    assert c == chat_alone
    assert_all_free(llm)


def test_stream_and_generate_in_two_threads(llm, alone):
    barrier = threading.Barrier(2, timeout=LIMIT_S)

    def stream():
        barrier.wait()
        return list(llm.generate(PROMPTS[0], greedy(8), stream=True))

    def gen():
        barrier.wait()
        return llm.generate(PROMPTS[1:3], greedy(4), use_tqdm=False)

    chunks, outs = bounded(stream, gen)
    assert joined(chunks)[0] == alone[(PROMPTS[0], 8)]
    assert [o.token_ids for o in outs] == [alone[(p, 4)] for p in PROMPTS[1:3]]
    assert_all_free(llm)


def test_abort_inside_the_stream_loop_ends_the_stream(llm):
    """Issue example 7: aborting each request as its first output arrives."""
    def loop():
        seen = []
        for o in llm.generate(PROMPTS[:2], greedy(30), stream=True):
            seen.append(o)
            llm.engine.abort_request(o.request_id)
        return seen

    seen, = bounded(loop)
    last = {o.request_id: o for o in seen}
    assert len(last) == 2 and all(o.finish_reason == "abort" for o in last.values())
    for rid, final in last.items():
        parts = [o for o in seen if o.request_id == rid]
        assert joined(parts)[1] == final.text and joined(parts)[0] == final.token_ids
    assert_all_free(llm)


def test_abort_from_another_thread(llm):
    # The stream is pull-driven (the engine steps only when a caller needs an output), so the
    # consumer holds still after its first output until the other thread's abort has landed:
    # the request cannot finish on its own first, whatever the two threads' timing.
    first, aborted_done = threading.Event(), threading.Event()
    rids = []

    def stream():
        out = []
        for o in llm.generate(PROMPTS[0], greedy(100), stream=True):
            rids.append(o.request_id)
            first.set()
            out.append(o)
            assert aborted_done.wait(LIMIT_S)
        return out

    def abort():
        assert first.wait(LIMIT_S)
        try:
            return llm.engine.abort_request(rids[0])
        finally:
            aborted_done.set()

    chunks, aborted = bounded(stream, abort)
    assert aborted is not None and aborted.finish_reason == "abort"
    assert chunks[-1].finish_reason == "abort" and len(chunks[-1].token_ids) < 100
    assert_all_free(llm)


def test_closing_one_stream_leaves_the_other(llm, alone):
    def run():
        it1 = llm.generate(PROMPTS[0], greedy(30), stream=True)
        it2 = llm.generate(PROMPTS[1], greedy(8), stream=True)
        next(it1), next(it2)
        it1.close()
        return list(it2)

    rest, = bounded(run)
    assert rest[-1].token_ids == alone[(PROMPTS[1], 8)] and rest[-1].finish_reason == "length"
    assert_all_free(llm)
