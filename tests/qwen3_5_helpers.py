"""A tiny random Qwen3.5 checkpoint (text, or a VLM with a patch-16 tower and Qwen's real
vocabulary) and a hand-driven step loop over our paged KV cache + state cache, for the Qwen3.5
decoder and VLM parity tests (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from atlas_vlm.layers.attention import build_attention_metadata
from mm_kv_cache_management.kv_cache import KVCacheSpec, PagedKVCache
from mm_kv_cache_management.state_cache import StateCache, StateMetadata

VOCAB = 320
BLOCK_SIZE = 4


#: the tiny decoder: 4 layers (3 linear, 1 full), partial rotary 0.25, interleaved M-RoPE, GQA in
#: both kinds of layer
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=512,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                                 mrope_section=[2, 1, 1], mrope_interleaved=True))


def tiny_config():
    """Scaled-down real Qwen3.5 config: the ``TEXT`` decoder and a tiny vision config."""
    from transformers import Qwen3_5Config

    return Qwen3_5Config(
        text_config=dict(TEXT),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=4, num_position_embeddings=16),
        architectures=["Qwen3_5ForConditionalGeneration"])


def tiny_vl_config():
    """The ``TEXT`` decoder over Qwen's real vocabulary (151936: the Qwen2.5 tokenizer's
    ``<|image_pad|>`` / ``<|video_pad|>`` / ``<|vision_start|>`` / ``<|vision_end|>`` ids) with a
    2-block tower of the released geometry (patch 16, merge 2, temporal patch 2), so prompts
    go through our media pipeline as a released checkpoint's do."""
    from transformers import Qwen3_5Config

    return Qwen3_5Config(
        text_config=dict(TEXT, vocab_size=151936, max_position_embeddings=4096, bos_token_id=151643,
                         eos_token_id=151645),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
        architectures=["Qwen3_5ForConditionalGeneration"])


def build_tiny_qwen3_5(out_dir: Path, seed: int = 0, mtp: dict[str, torch.Tensor] | None = None,
                       text_only: bool = False, config=None):
    """Save a random tiny ``Qwen3_5ForConditionalGeneration`` of ``config`` (default
    ``tiny_config()``; ``text_only``: a ``Qwen3_5ForCausalLM`` of its text config) in fp32 + the
    Qwen tokenizer (with the Qwen3-VL chat template, which Qwen3.5 renders media with) to
    ``out_dir``; ``mtp`` tensors are added to the checkpoint under ``mtp.<name>``. Returns the
    HF model (eval)."""
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    from atlas_vlm.models.qwen2_vl.tokenizer_files import qwen_tokenizer_dir
    from atlas_vlm.models.qwen3_vl.vision import QWEN3_VL_CHAT_TEMPLATE

    torch.manual_seed(seed)
    config = config or tiny_config()
    if text_only:
        config = config.text_config
        config.architectures = ["Qwen3_5ForCausalLM"]
        model = Qwen3_5ForCausalLM(config).eval()
    else:
        model = Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():  # random norms (their zero-centred form is tested) and larger weights
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif p.dim() == 2 and "embed" not in name:
                p.mul_(3.0)
    model.save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    if mtp:
        path = out_dir / "model.safetensors"
        tensors = load_file(str(path))
        tensors.update({f"mtp.{k}": v for k, v in mtp.items()})
        save_file(tensors, str(path), metadata={"format": "pt"})
    return model


class StepDriver:
    """Runs our model step by step over a ``PagedKVCache`` + ``StateCache``, as the engine
    would: each sequence owns blocks and one state slot; ``step`` takes each sequence's new
    tokens and returns each sequence's logits ``[new_tokens, vocab]``. ``backend``: the
    attention metadata's backend (``layers.attention.ATTENTION_BACKENDS``)."""

    def __init__(self, model, num_blocks: int = 128, num_slots: int = 4, backend: str = "reference"):
        arch = model.arch
        self.model, self.backend = model, backend
        spec = KVCacheSpec(num_layers=model.num_kv_layers, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
                           dtype=torch.float32)
        self.kv = PagedKVCache(spec, num_blocks=num_blocks, block_size=BLOCK_SIZE)
        self.state = StateCache(model.state_spec(), num_slots)
        self.next_block = 1  # block 0 is the padding block
        self.seqs: dict[str, dict] = {}

    def add(self, name: str) -> None:
        self.seqs[name] = dict(len=0, blocks=[], slot=self.state.allocate())

    def step(self, new_tokens: dict[str, list[int]], positions: dict[str, torch.Tensor] | None = None,
             mm: dict[str, list[tuple[int, torch.Tensor]]] | None = None,
             drafts: dict[str, int] | None = None) -> dict[str, torch.Tensor]:
        """One forward. ``positions``: a sequence's M-RoPE positions ``[3, new_tokens]``
        (default: text positions from its length); ``mm``: a sequence's media rows as
        ``input_prep.mm_rows_for_chunk`` gives them (first token index within its new tokens,
        rows ``[n, hidden]``), which replace those tokens' embeddings; ``drafts``: a sequence
        whose new tokens are a verification step's (``meta.state.num_drafts``)."""
        positions, mm = positions or {}, mm or {}
        q_lens, c_lens, slots, tables, pos, ids, rows, index = [], [], [], [], [], [], [], []
        for name, toks in new_tokens.items():
            for first, r in mm.get(name, []):
                rows.append(r)
                index += range(len(ids) + first, len(ids) + first + len(r))
            seq = self.seqs[name]
            start = seq["len"]
            seq["len"] += len(toks)
            while len(seq["blocks"]) * BLOCK_SIZE < seq["len"]:
                seq["blocks"].append(self.next_block)
                self.next_block += 1
            for p in range(start, seq["len"]):
                slots.append(seq["blocks"][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            q_lens.append(len(toks))
            c_lens.append(seq["len"])
            tables.append(list(seq["blocks"]))
            pos.append(positions[name] if name in positions else torch.arange(start, seq["len"])[None].expand(3, -1))
            ids += toks
        meta = build_attention_metadata(q_lens, c_lens, slots, tables, backend=self.backend)
        meta.state = StateMetadata(self.state, torch.tensor([self.seqs[n]["slot"] for n in new_tokens]),
                                   torch.tensor([c > q for q, c in zip(q_lens, c_lens)]),
                                   num_drafts=[(drafts or {}).get(n, 0) for n in new_tokens])
        with torch.no_grad():
            x = self.model.embed(torch.tensor(ids), torch.cat(rows) if rows else None,
                                   torch.tensor(index, dtype=torch.long))
            logits = self.model.compute_logits(self.model(x, torch.cat(pos, dim=1), self.kv, meta))
        return dict(zip(new_tokens, logits.split(q_lens)))


def random_mtp_weights(text_config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random ``mtp.*`` tensors (names without the prefix) for a Qwen3.5 text config, shaped as
    a released checkpoint's MTP head (one layer: HF's separate q/k/v and gate/up projections,
    ``q_proj`` of query + gate); HF's ``save_pretrained`` drops ``mtp.*``, so tests add these
    with ``build_tiny_qwen3_5(mtp=...)``. Norm weights are random around 0 (zero-centred)."""
    c = text_config
    g = torch.Generator().manual_seed(seed)
    h, inter, hd = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd

    def w(*shape, scale=None):
        return torch.randn(*shape, generator=g) * (scale if scale is not None else shape[-1] ** -0.5)

    out = {"fc.weight": w(h, 2 * h), "norm.weight": w(h, scale=0.2), "pre_fc_norm_embedding.weight": w(h, scale=0.2),
           "pre_fc_norm_hidden.weight": w(h, scale=0.2)}
    layer = {"input_layernorm.weight": w(h, scale=0.2), "post_attention_layernorm.weight": w(h, scale=0.2),
             "self_attn.q_proj.weight": w(2 * q, h), "self_attn.k_proj.weight": w(kv, h),
             "self_attn.v_proj.weight": w(kv, h), "self_attn.o_proj.weight": w(h, q),
             "self_attn.q_norm.weight": w(hd, scale=0.2), "self_attn.k_norm.weight": w(hd, scale=0.2),
             "mlp.gate_proj.weight": w(inter, h), "mlp.up_proj.weight": w(inter, h),
             "mlp.down_proj.weight": w(h, inter)}
    out.update({f"layers.0.{k}": v for k, v in layer.items()})
    return out


def record_cached_and_logits(llm):
    """Give ``llm`` a ``seen`` dict, request id -> (num_cached_tokens at its first sampled row,
    [its sampled logits rows]), filled by a runner observer; returns ``llm``."""
    llm.seen = {}

    def observe(chunks, inp, logits, sampled):
        for row, i in enumerate(sampled):
            req = chunks[i][0]
            llm.seen.setdefault(req.request_id, (req.num_cached_tokens, []))[1].append(logits[row].clone())
    llm.engine.runner.observers.append(observe)
    return llm
