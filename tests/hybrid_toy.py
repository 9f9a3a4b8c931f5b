"""A toy hybrid model for the engine's state-slot tests, and its cache-free reference.

``HybridToyLM`` is our Llama decoder (``models.decoder.CausalLM``) with the self-attention of
some layers replaced by ``ToyRecurrentMixer``: an exact, simple recurrent layer shaped like
Gated DeltaNet's state (a causal depthwise conv1d over ``conv_dim`` channels keeping the last
``kernel - 1`` inputs, then per value head ``S = 0.9 S + k v^T``, ``o = q S``) that reads and
writes ``meta.state`` (``mm_kv_cache_management.StateMetadata``). The remaining attention
layers keep K/V at cache layers ``0 .. num_kv_layers - 1`` in layer order.

``reference_greedy`` recomputes every sequence from token 0 with no cache at all (no KV, a
zero state each time), so anything the engine gets wrong about slots, chunk boundaries,
preemption or aborts shows up as different tokens or logprobs. ``toy_llm`` builds an ``LLM``
over a random tiny Llama folder with the toy swapped in at load time.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from atlas_vlm.layers.attention import build_attention_metadata
from atlas_vlm.models.decoder import CausalLM
from mm_kv_cache_management import StateSpec, state_spec_from_config

DECAY = 0.9


class ToyRecurrentMixer(nn.Module):
    """Stands in for ``Attention`` in one layer: ``forward(x, cos, sin, kv_cache, meta)``.

    ``state_layer``: this layer's index in the ``StateCache`` (linear layers in layer order).
    Without ``meta.state`` (the reference) every sequence starts from zero and nothing is kept.
    """

    def __init__(self, hidden: int, spec: StateSpec, state_layer: int):
        super().__init__()
        self.spec, self.state_layer = spec, state_layer
        h, dk, dv = spec.num_v_heads, spec.k_head_dim, spec.v_head_dim
        self.in_proj = nn.Linear(hidden, spec.conv_dim, bias=False)  # [q | k | v] = 2 h dk + h dv
        self.conv_weight = nn.Parameter(torch.randn(spec.conv_dim, spec.conv_kernel) * 0.5)
        self.out_proj = nn.Linear(h * dv, hidden, bias=False)

    def _run(self, u: torch.Tensor, conv: torch.Tensor, rec: torch.Tensor):
        """One sequence's new rows ``u`` ``[T, conv_dim]`` from state ``(conv [conv_dim, K-1],
        rec [h, dk, dv])`` -> (output ``[T, h dv]``, new conv, new rec)."""
        s = self.spec
        window = torch.cat([conv.T, u.float()])  # [K - 1 + T, conv_dim]
        mixed = F.silu((window.unfold(0, s.conv_kernel, 1) * self.conv_weight.float()).sum(-1))  # [T, conv_dim]
        kd = s.num_v_heads * s.k_head_dim  # the toy's key heads are its value heads
        q, k, v = mixed.split([kd, kd, s.num_v_heads * s.v_head_dim], dim=-1)
        q = q.view(-1, s.num_v_heads, s.k_head_dim) * s.k_head_dim ** -0.5
        k = F.normalize(k.view(-1, s.num_v_heads, s.k_head_dim), dim=-1)
        v = v.view(-1, s.num_v_heads, s.v_head_dim)
        outs = []
        for t in range(u.shape[0]):  # token by token: the same ops in the engine and the reference
            rec = DECAY * rec + k[t, :, :, None] * v[t, :, None, :]
            outs.append(torch.einsum("hk,hkv->hv", q[t], rec).reshape(-1))
        return torch.stack(outs), window[-(s.conv_kernel - 1):].T.contiguous(), rec

    def forward(self, x, cos, sin, kv_cache, meta) -> torch.Tensor:
        u, state, s = self.in_proj(x), getattr(meta, "state", None), self.spec
        outs, start = [], 0
        for i, n in enumerate(meta.query_lens):
            conv, rec = torch.zeros(s.conv_shape), torch.zeros(s.recurrent_shape)
            if state is not None and bool(state.has_initial_state[i]):
                slot = int(state.slots[i])
                conv, rec = state.cache.conv[self.state_layer, slot], state.cache.recurrent[self.state_layer, slot]
            out, conv, rec = self._run(u[start:start + n], conv.clone(), rec.clone())
            if state is not None:
                slot = int(state.slots[i])
                state.cache.conv[self.state_layer, slot] = conv
                state.cache.recurrent[self.state_layer, slot] = rec
            outs.append(out)
            start += n
        return self.out_proj(torch.cat(outs).to(x.dtype))


class HybridToyLM(CausalLM):
    """``CausalLM`` whose layers ``linear_layers`` are ``ToyRecurrentMixer``s (a hybrid model:
    ``state_spec()`` and ``num_kv_layers``). Build with ``from_causal_lm``."""

    def __init__(self, arch, hf_text_config, linear_layers, spec: StateSpec):
        super().__init__(arch, hf_text_config)
        self.linear_layers, self._spec = sorted(linear_layers), spec
        kv_index = 0
        for i, layer in enumerate(self.model.layers):
            if i in self.linear_layers:
                layer.self_attn = ToyRecurrentMixer(arch.hidden_size, spec, self.linear_layers.index(i))
            else:
                layer.self_attn.layer_idx = kv_index  # K/V layers 0 .. num_kv_layers - 1, in layer order
                kv_index += 1
        self.num_kv_layers = kv_index

    def state_spec(self) -> StateSpec:
        return self._spec

    @classmethod
    def from_causal_lm(cls, base: CausalLM, hf_text_config, seed: int = 0) -> HybridToyLM:
        """The toy with ``base``'s weights (the replaced attentions' dropped), mixers seeded;
        its recurrent layers and their state are the config's (``layer_types``, ``linear_*``:
        ``state_spec_from_config``, as for Qwen3.5)."""
        spec = state_spec_from_config(hf_text_config)
        linear_layers = [i for i, t in enumerate(hf_text_config.layer_types) if t == "linear_attention"]
        torch.manual_seed(seed)
        toy = cls(base.arch, hf_text_config, linear_layers, spec)
        missing, _ = toy.load_state_dict(base.state_dict(), strict=False)
        if any("self_attn" not in k for k in missing):
            raise ValueError(f"weights missing from the base model: {missing}")
        param = next(base.parameters())
        return toy.to(device=param.device, dtype=param.dtype).eval()


@torch.inference_mode()
def reference_greedy(model: HybridToyLM, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs, every step a cache-free forward of the whole sequence."""
    ids, tokens, logprobs = list(prompt_ids), [], []
    for _ in range(max_tokens):
        n = len(ids)
        meta = build_attention_metadata([n], [n], list(range(n)), [[0]])
        x = model.embed(torch.tensor(ids))
        logits = model.compute_logits(model(x, torch.arange(n), None, meta)[-1:])[0]
        token = int(logits.argmax())
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        ids.append(token)
    return tokens, logprobs


HYBRID_FIELDS = dict(layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
                     linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4)


def build_tiny_llama(out_dir: Path, seed: int = 0) -> Path:
    """A random tiny 4-layer Llama + the Qwen2.5 tokenizer saved in ``out_dir``; its config also
    carries Qwen3.5's hybrid fields (``HYBRID_FIELDS``: layers 0-2 linear attention), which
    the toy and the planner read and HF's Llama ignores."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from atlas_vlm.models.qwen2_vl.tokenizer_files import qwen_tokenizer_dir
    from tiny_vlms import QWEN_VOCAB

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=QWEN_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645,
                         architectures=["LlamaForCausalLM"], **HYBRID_FIELDS)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # std 0.02 weights give near-ties; scaled up, tokens differ clearly
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(4.0)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(qwen_tokenizer_dir()).save_pretrained(out_dir)
    return out_dir


@contextmanager
def toy_swapped_in():
    """While open, every engine built loads its model as ``HybridToyLM`` (recurrent layers as
    its config says); yields the list of toys built (the reference runs on the same weights)."""
    import atlas_vlm.engine.engine as engine_module

    real, built = engine_module.load_model, []

    def load(*args, **kwargs):
        loaded = real(*args, **kwargs)
        loaded.model = HybridToyLM.from_causal_lm(loaded.model, loaded.hf_config)
        built.append(loaded.model)
        return loaded

    engine_module.load_model = load
    try:
        yield built
    finally:
        engine_module.load_model = real
