"""Where a Qwen3.5 decode step spends its time: the Gated DeltaNet layers' share, split into
the conv1d state update (+ state gather / write-back), the recurrent gated delta rule and the
gated RMSNorm; the rest of those layers is their four input projections and ``out_proj``.

A random (untrained) tiny-but-not-trivial Qwen3.5 text decoder, built from a config (nothing
read or downloaded): hidden 512, 8 layers (6 Gated DeltaNet, 2 gated full attention), linear
heads 4 key / 8 value x 64, full attention 8 / 2 heads x 64. Every sequence decodes at
context ``--context`` over a paged KV cache + ``StateCache``; times are wall-clock
(``time.perf_counter``) per decode step, median of ``--steps`` steps after warm-up, one
thread by default (``--threads``). Forward hooks time each part, so parts add up to a little
more than their share of an un-hooked step.

``--kernel off`` fakes the C decode kernel (``atlas_vlm.kernels.gated_delta``) absent, so the
layer runs HF's PyTorch rule; ``on`` uses it where available; ``both`` (default) alternates the
two step by step on one model and prints the speedups.

Run: ``python -m benchmarks.gated_delta [--batches 1 16] [--dtypes fp32 bf16]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from atlas_vlm.kernels import gated_delta
from atlas_vlm.layers.attention import build_attention_metadata
from atlas_vlm.models.arch import ModelArch
from atlas_vlm.models.qwen3_5 import gated_deltanet
from atlas_vlm.models.qwen3_5.model import Qwen3_5ForCausalLM
from mm_kv_cache_management.kv_cache import KVCacheSpec, PagedKVCache
from mm_kv_cache_management.state_cache import StateCache, StateMetadata

BLOCK = 16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_model(dtype: torch.dtype) -> Qwen3_5ForCausalLM:
    """The random decoder described in the module docstring, in ``dtype`` (eval)."""
    from transformers import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(vocab_size=2048, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                            num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
                            linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
                            linear_conv_kernel_dim=4,
                            rope_parameters=dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.25,
                                                 mrope_section=[4, 2, 2], mrope_interleaved=True),
                            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2)
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    torch.manual_seed(0)
    return Qwen3_5ForCausalLM(ModelArch.from_hf_config(cfg), cfg).to(dtype).eval()


class Timers:
    """Accumulated seconds per part, via forward hooks and wrapped functions."""

    def __init__(self):
        self.total: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.total[name] = self.total.get(name, 0.0) + seconds

    def hook(self, module: torch.nn.Module, name: str) -> None:
        start = {}
        module.register_forward_pre_hook(lambda *_: start.__setitem__("t", time.perf_counter()))
        module.register_forward_hook(lambda *_: self.add(name, time.perf_counter() - start["t"]))

    def wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - t0)
        setattr(owner, attr, timed)


def measure(dtype: torch.dtype, batch: int, context: int, steps: int, modes: list[bool]) -> dict[bool, dict]:
    """Per mode (True: the C kernel where available, False: faked absent), the median seconds
    per decode step (``"step"``) and per part summed over layers. The modes alternate step by
    step on one model, so load from other processes falls on each alike."""
    model = build_model(dtype)
    spec = KVCacheSpec(num_layers=model.num_kv_layers, num_kv_heads=2, head_dim=64, dtype=dtype)
    total = (steps + 3) * len(modes)
    blocks_per_seq = (context + total + 8) // BLOCK + 1
    kv = PagedKVCache(spec, num_blocks=batch * blocks_per_seq + 1, block_size=BLOCK)
    state = StateCache(model.state_spec(), batch)
    state.conv.normal_(), state.recurrent.normal_(0, 0.05)
    tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)) for i in range(batch)]
    timers = Timers()
    layers = [layer.linear_attn for layer in model.model.layers if layer.layer_type == "linear_attention"]
    for m in layers:
        timers.hook(m, "gdn_layer")
        timers.hook(m.norm, "gated_norm")
        timers.wrap(m, "_mix", "conv+rule (PyTorch)")
    timers.wrap(gated_deltanet, "torch_recurrent_gated_delta_rule", "rule (PyTorch)")
    timers.wrap(gated_deltanet.gated_delta, "decode_step", "conv+rule (C kernel)")
    real_available = gated_delta.available
    per_step = {mode: [] for mode in modes}
    parts = {mode: [] for mode in modes}
    try:
        for s in range(total):
            mode = modes[s % len(modes)]
            gated_delta.available = real_available if mode else (lambda: False)
            c = context + s
            meta = build_attention_metadata([1] * batch, [c] * batch,
                                            [t[(c - 1) // BLOCK] * BLOCK + (c - 1) % BLOCK for t in tables],
                                            [t[:(c - 1) // BLOCK + 1] for t in tables], backend="decode_kernel")
            meta.state = StateMetadata(state, torch.arange(batch).flip(0), torch.ones(batch, dtype=torch.bool))
            x = model.embed(torch.randint(0, 2048, (batch,)))
            timers.total.clear()
            t0 = time.perf_counter()
            with torch.no_grad():
                model.compute_logits(model(x, torch.full((batch,), c - 1), kv, meta))
            if s >= 3 * len(modes):
                per_step[mode].append(time.perf_counter() - t0)
                parts[mode].append(dict(timers.total))
    finally:
        gated_delta.available = real_available
    results = {}
    for mode in modes:
        for p in parts[mode]:  # the conv1d state update (+ state gather / write-back): _mix without the rule
            if "rule (PyTorch)" in p:
                p["conv+state (PyTorch)"] = p["conv+rule (PyTorch)"] - p["rule (PyTorch)"]
        results[mode] = {"step": statistics.median(per_step[mode])}
        for name in parts[mode][0]:
            results[mode][name] = statistics.median(p[name] for p in parts[mode])
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kernel", choices=["on", "off", "both"], default="both")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.kernel]
    print(f"threads {args.threads}, context {args.context}, median of {args.steps} decode steps per mode; "
          f"C kernel available: {gated_delta.available()}")
    for dname in args.dtypes:
        for batch in args.batches:
            results = measure(DTYPES[dname], batch, args.context, args.steps, modes)
            for use_kernel, r in results.items():
                step = r["step"]
                shares = ", ".join(f"{k} {v * 1e3:.2f} ms ({100 * v / step:.0f}%)" for k, v in sorted(r.items())
                                   if k != "step")
                print(f"{dname} batch {batch:2d} kernel {'on ' if use_kernel else 'off'}: step {step * 1e3:.2f} ms"
                      f" | {shares}")
            if len(results) == 2:
                off, on = results[False], results[True]
                print(f"  speedup: decode step {off['step'] / on['step']:.2f}x, Gated DeltaNet layers "
                      f"{off['gdn_layer'] / on['gdn_layer']:.2f}x, conv+rule "
                      f"{off['conv+rule (PyTorch)'] / on['conv+rule (C kernel)']:.2f}x")


if __name__ == "__main__":
    main()
