"""llama.cpp as a peer, through ``llama-cpp-python``, on the very GGUF our engine loads.

llama.cpp computes on the GGUF's own quantized weights (our engine dequantizes them to the
dtype in use), so its greedy tokens are compared with HF's and reported, not required equal.
Its Python binding runs one sequence at a time: many requests run one after another.

Optional: ``pip install llama-cpp-python`` (it builds llama.cpp from source; on a CPU where a
native build dies with an illegal instruction, see ``scripts/setup.sh --bench`` for the CMAKE_ARGS).
Every function here is called only when ``available()`` returns None.

Times are seconds (``benchmarks.common.now``); decode tok/s = (N - 1) / (time of the last
token - time of the first), as for our engine and HF.
"""

from __future__ import annotations

from benchmarks.common import now


def available() -> str | None:
    """None when ``llama_cpp`` imports, else why not (shown in the tables as the peer's row)."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        return "not installed" if isinstance(e, ModuleNotFoundError) else f"import failed: {type(e).__name__}: {e}"
    return None


def system_info() -> str:
    """llama.cpp's own ``system_info`` line (the instruction sets its CPU backend was built
    with, e.g. ``AVX512_VNNI = 1``), or why the peer is not available."""
    why = available()
    if why is not None:
        return f"llama.cpp {why}"
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode().strip()


def load(gguf: str, n_ctx: int, threads: int):
    """A ``llama_cpp.Llama`` on ``gguf`` with room for ``n_ctx`` tokens, ``threads`` CPU threads
    (prefill and decode), 512-token prefill batches (llama.cpp's default)."""
    from llama_cpp import Llama

    return Llama(model_path=gguf, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                 verbose=False)


def stream(llm, ids: list[int], n: int) -> dict:
    """One greedy request of exactly ``n`` new tokens (EOS not special: ``generate`` does not
    stop on it). Returns seconds (total, to first token, first to last token) and the ids."""
    llm.reset()
    tokens, t0, first = [], now(), None
    for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        if first is None:
            first = now()
        tokens.append(int(tok))
        if len(tokens) == n:
            break
    end = now()
    return {"total_s": end - t0, "ttft_s": first - t0, "decode_s": end - first, "tokens": tokens}


def sequential(llm, prompts: list[list[int]], outs: list[int]) -> tuple[float, list[list[int]]]:
    """Every request one after another (the binding has no batching): (wall seconds, ids)."""
    toks, t0 = [], now()
    for p, n in zip(prompts, outs):
        toks.append(stream(llm, p, n)["tokens"])
    return now() - t0, toks
