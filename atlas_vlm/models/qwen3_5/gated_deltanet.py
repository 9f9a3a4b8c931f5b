"""Qwen3.5's linear-attention token mixer (Gated DeltaNet) over per-sequence state slots.

Source of the rules: HF transformers 5.25 ``modeling_qwen3_5.py`` (``Qwen3_5GatedDeltaNet``,
``Qwen3_5RMSNormGated``, ``causal_conv1d_fn`` / ``causal_conv1d_update``). The gated delta
rule itself is HF's own ``torch_chunk_gated_delta_rule`` (prefill, chunks) and
``torch_recurrent_gated_delta_rule`` (one new token), called as they are.

Tokens arrive flattened across sequences (``meta.query_lens``, in order). Each sequence only
sees its own tokens: sequences with one new token (decode) run together as one batch of the
recurrent rule (on CPU through the C kernel ``atlas_vlm.kernels.gated_delta`` where it builds:
conv, rule and state update in one call, the same answer); every longer one runs alone
through the chunked rule. On CUDA (``rule_backend``, ``gated_delta_backend.use_triton``) both run in
Triton (``kernels.triton_gated_delta``, ``kernels.triton_gated_delta_chunk``). A sequence reads its
conv and recurrent state from ``meta.state.cache`` at slot ``meta.state.slots[i]`` (zero when
``has_initial_state[i]`` is False) and writes the final state back there (fp32).

A verification sequence (speculative decoding: ``meta.state.num_drafts[i] = k`` > 0, its
``k + 1`` rows the last sampled token and ``k`` drafts) runs its rows one token at a time, as
``k + 1`` decode steps would (the C kernel or the recurrent rule, batched with the other
verification sequences at the same row): the state after each of its first ``k`` rows is
kept (``StateCache.keep_row``) so ``StateCache.accept_rows`` can put the slot right after the
sampler took some of them; its slot holds the state after all ``k + 1``.

A prefill sequence with ``meta.state.snapshots[i]`` runs its chunk in pieces split at those
points and also writes the state after each piece into its snapshot slot (prefix caching;
exact up to fp32 rounding, as any chunked prefill).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.models.qwen3_5.modeling_qwen3_5 import (torch_chunk_gated_delta_rule,
                                                          torch_recurrent_gated_delta_rule)

from atlas_vlm.kernels import gated_delta, gated_delta_backend


class RMSNormGated(nn.Module):
    """HF ``Qwen3_5RMSNormGated``: ``weight * rmsnorm(x) * silu(gate)`` (a plain weight, not
    zero-centred), normalised in fp32. ``x``, ``gate``: ``[n, head_v_dim]``."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer; parameter names as HF's (``in_proj_qkv``, ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a``, ``conv1d``, ``dt_bias``, ``A_log``, ``norm``, ``out_proj``).

    Args:
        config: the HF ``Qwen3_5TextConfig``.
        state_layer: this layer's index into the state cache (its rank among the
            linear-attention layers).
    """

    def __init__(self, config, state_layer: int):
        super().__init__()
        self.state_layer = state_layer
        self.num_v_heads, self.num_k_heads = config.linear_num_value_heads, config.linear_num_key_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim, self.value_dim = self.head_k_dim * self.num_k_heads, self.head_v_dim * self.num_v_heads
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = config.linear_conv_kernel_dim
        hidden = config.hidden_size
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, bias=False, groups=self.conv_dim)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = RMSNormGated(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)
        self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.act_name = config.hidden_act
        self.act = ACT2FN[config.hidden_act]
        self.rule_backend = "auto"  # gated_delta_backend.use_triton: "auto" (Triton on CUDA), "triton", "torch"

    def forward(self, x: torch.Tensor, meta) -> torch.Tensor:
        """``x`` ``[num_tokens, hidden]`` (sequences flattened as ``meta.query_lens``) ->
        ``[num_tokens, hidden]``; the state slots of ``meta.state`` are read and updated.

        Raises:
            ValueError: ``meta.state`` is None while some sequence continues an earlier step
                (only a full prefill from token 0 may run without a state cache; its state
                is then dropped), its slots / flags are not one per sequence, the query
                lengths do not cover ``x``, or a verification sequence is malformed
                (``_num_drafts``).
        """
        q_lens, state = list(meta.query_lens), meta.state
        if sum(q_lens) != x.shape[0]:
            raise ValueError(f"meta.query_lens {q_lens} do not add up to the {x.shape[0]} tokens given")
        if state is None and list(meta.context_lens) != q_lens:
            raise ValueError("a Gated DeltaNet layer needs meta.state (a StateMetadata) for sequences that "
                             "continue an earlier step")
        if state is not None and not (len(state.slots) == len(state.has_initial_state) == len(q_lens)):
            raise ValueError(f"meta.state gives {len(state.slots)} slots and {len(state.has_initial_state)} "
                             f"has_initial_state flags for {len(q_lens)} sequences")
        drafts = self._num_drafts(q_lens, state)
        triton = gated_delta_backend.use_triton(self.rule_backend, x.device, x.dtype, self.head_k_dim, self.head_v_dim,
                                        getattr(meta, "triton", None) is not None)
        qkv, z = self.in_proj_qkv(x), self.in_proj_z(x)  # [T, conv_dim], [T, value_dim]
        b, a = self.in_proj_b(x), self.in_proj_a(x)  # [T, num_v_heads]
        out = torch.empty(x.shape[0], self.value_dim, dtype=x.dtype, device=x.device)
        starts = [0, *itertools.accumulate(q_lens)][:-1]
        decode = [i for i, q in enumerate(q_lens) if q == 1]
        groups = ([decode] if decode else []) + [[i] for i, q in enumerate(q_lens) if q > 1 and not drafts[i]]
        for seqs in groups:  # decode sequences as one batch, each prefill alone
            n, length = len(seqs), q_lens[seqs[0]]
            if n == len(q_lens) and length == 1:  # a decode-only step: every row, in order
                rows = slice(None)
            else:
                rows = torch.tensor([r for i in seqs for r in range(starts[i], starts[i] + q_lens[i])],
                                    device=x.device)
            out[rows] = self._run_rows(seqs, rows, length, qkv, b, a, state, x, triton)
        verify = [i for i, k in enumerate(drafts) if k]
        for t in range(max(drafts) + 1 if verify else 0):  # verification rows: row t of each, as a decode
            seqs = [i for i in verify if drafts[i] >= t]
            rows = torch.tensor([starts[i] + t for i in seqs], device=x.device)
            out[rows] = self._run_rows(seqs, rows, 1, qkv, b, a, state, x, triton)
            for i in seqs:
                if t < drafts[i]:  # the state after this row, for accept_rows
                    state.cache.keep_row(self.state_layer, int(state.slots[i]), t, drafts[i])
        z = z.reshape(-1, self.head_v_dim)
        core = self.norm(out.reshape(-1, self.head_v_dim), z).reshape(x.shape[0], self.value_dim)
        return self.out_proj(core)

    @staticmethod
    def _num_drafts(q_lens: list[int], state) -> list[int]:
        """Drafts verified per sequence (``meta.state.num_drafts``; zeros when None).

        Raises:
            ValueError: not one per sequence, or a verification sequence whose rows are not
                ``k + 1`` or that does not continue a state (drafts follow a decoded token)."""
        drafts = None if state is None else state.num_drafts
        if not drafts:
            return [0] * len(q_lens)
        drafts = [int(k) for k in drafts]
        if len(drafts) != len(q_lens):
            raise ValueError(f"meta.state.num_drafts gives {len(drafts)} entries for {len(q_lens)} sequences")
        for i, (k, q) in enumerate(zip(drafts, q_lens)):
            if k and (k < 0 or q != k + 1 or not bool(state.has_initial_state[i])):
                raise ValueError(f"sequence {i}: {k} drafts need {k + 1} rows continuing a state, got {q} rows "
                                 f"(has_initial_state={bool(state.has_initial_state[i])})")
        return drafts

    def _run_rows(self, seqs: list[int], rows, length: int, qkv, b, a, state, x, triton: bool) -> torch.Tensor:
        """Conv + rule for ``len(seqs)`` sequences of ``length`` rows each (``rows``: their
        flat indices, sequence after sequence), reading and writing their slots; one-row
        sequences through Triton (``triton``) or the C kernel where it serves. Returns
        ``[n * length, value_dim]``."""
        n = len(seqs)
        decode = gated_delta.decode_step
        if triton and length == 1 and self.act_name == "silu" and state is not None and \
                state.cache.conv.device == x.device:
            from atlas_vlm.kernels import triton_gated_delta
            decode = triton_gated_delta.decode_step
        if length == 1 and (decode is not gated_delta.decode_step or self._kernel_serves(x, state)):
            return decode(
                qkv[rows], b[rows], a[rows], self.conv1d.weight, self.A_log, self.dt_bias,
                state.cache.conv[self.state_layer], state.cache.recurrent[self.state_layer], state.slots[seqs],
                state.has_initial_state[seqs], self.num_k_heads, self.head_k_dim,
                self.head_v_dim).reshape(n, self.value_dim)
        core = self._mix(seqs, qkv[rows].view(n, length, -1), b[rows].view(n, length, -1),
                         a[rows].view(n, length, -1), state, triton)  # [n, length, num_v_heads, head_v_dim]
        return core.reshape(n * length, self.value_dim)

    def _kernel_serves(self, x: torch.Tensor, state) -> bool:
        """Whether this step's decode batch goes through the C kernel (``kernels.gated_delta``):
        state slots given, SiLU conv activation, sizes and device it takes, and it builds here."""
        return (state is not None and self.act_name == "silu" and state.cache.conv.device == x.device
                and gated_delta.unsupported_reason(x.device, x.dtype, self.num_k_heads, self.num_v_heads,
                                                   self.head_k_dim, self.head_v_dim, self.kernel) is None)

    def _mix(self, seqs: list[int], qkv, b, a, state, triton: bool) -> torch.Tensor:
        """Conv + gated delta rule for ``len(seqs)`` sequences of equal length ``L``:
        ``qkv`` ``[n, L, conv_dim]``, ``b``/``a`` ``[n, L, num_v_heads]`` -> ``[n, L, num_v_heads, head_v_dim]``;
        the chunked rule in Triton when ``triton``."""
        n, length, _ = qkv.shape
        chunk_rule = torch_chunk_gated_delta_rule
        if triton:
            from atlas_vlm.kernels.triton_gated_delta_chunk import chunk_gated_delta_rule as chunk_rule
        if n == 1 and length > 1 and state is not None and state.snapshots and state.snapshots[seqs[0]]:
            return self._mix_snapshots(seqs, qkv, b, a, state, chunk_rule)  # a prefill that also snapshots its state
        conv_state, rec_state = self._read_state(seqs, state, qkv)
        weight = self.conv1d.weight  # [conv_dim, 1, kernel]
        window = torch.cat([conv_state.to(weight.dtype), qkv.transpose(1, 2).to(weight.dtype)], dim=-1)
        mixed = self.act(F.conv1d(window, weight, groups=self.conv_dim)).to(qkv.dtype)  # [n, conv_dim, L]
        mixed = mixed.transpose(1, 2)
        query, key, value = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.reshape(n, length, -1, self.head_k_dim)
        key = key.reshape(n, length, -1, self.head_k_dim)
        value = value.reshape(n, length, -1, self.head_v_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # HF: fp32 so A never overflows
        rule = torch_recurrent_gated_delta_rule if length == 1 and not triton else chunk_rule
        core, final = rule(query, key, value, g=g, beta=beta, initial_state=rec_state, output_final_state=True,
                           use_qk_l2norm_in_kernel=True)
        if state is not None:
            slots = state.slots[seqs].to(state.cache.conv.device)
            state.cache.conv[self.state_layer, slots] = window[..., -(self.kernel - 1):].to(state.cache.conv.dtype)
            state.cache.recurrent[self.state_layer, slots] = final.to(state.cache.recurrent.dtype)
        return core

    def _mix_snapshots(self, seqs: list[int], qkv, b, a, state, chunk_rule) -> torch.Tensor:
        """``_mix`` for one prefill sequence (``seqs == [i]``) that snapshots its state: the
        chunk is split after each ``k`` of ``state.snapshots[i]``; the state after a piece goes
        to its snapshot slot of ``state.snapshot_cache`` and seeds the next piece."""
        (i,) = seqs
        conv_state, rec_state = self._read_state(seqs, state, qkv)
        weight, width = self.conv1d.weight, self.kernel - 1
        cores, prev = [], 0
        for end, slot in [*state.snapshots[i], (qkv.shape[1], None)]:
            if end > prev:
                piece = qkv[:, prev:end].transpose(1, 2).to(weight.dtype)  # [1, conv_dim, end - prev]
                window = torch.cat([conv_state.to(weight.dtype), piece], -1)
                mixed = self.act(F.conv1d(window, weight, groups=self.conv_dim)).to(qkv.dtype).transpose(1, 2)
                query, key, value = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
                g = -self.A_log.float().exp() * F.softplus(a[:, prev:end].float() + self.dt_bias)
                core, rec_state = chunk_rule(
                    query.reshape(1, end - prev, -1, self.head_k_dim), key.reshape(1, end - prev, -1, self.head_k_dim),
                    value.reshape(1, end - prev, -1, self.head_v_dim), g=g, beta=b[:, prev:end].sigmoid(),
                    initial_state=rec_state, output_final_state=True, use_qk_l2norm_in_kernel=True)
                conv_state = window[..., -width:].float()
                cores.append(core)
                prev = end
            target, dst = (state.snapshot_cache, slot) if slot is not None else (state.cache, int(state.slots[i]))
            target.conv[self.state_layer, dst] = conv_state[0].to(target.conv.device, target.conv.dtype)
            target.recurrent[self.state_layer, dst] = rec_state[0].to(target.recurrent.device, target.recurrent.dtype)
        return torch.cat(cores, dim=1)

    def _read_state(self, seqs: list[int], state, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Conv state ``[n, conv_dim, kernel - 1]`` and recurrent state
        ``[n, num_v_heads, k_head_dim, v_head_dim]`` (None: all zero) of ``seqs``."""
        n = len(seqs)
        zeros = torch.zeros(n, self.conv_dim, self.kernel - 1, dtype=torch.float32, device=like.device)
        if state is None:
            return zeros, None
        fresh = ~state.has_initial_state[seqs].to(like.device)  # [n] True: starts from zero
        if bool(fresh.all()):
            return zeros, None
        slots = state.slots[seqs].to(state.cache.conv.device)
        conv = state.cache.conv[self.state_layer, slots].to(like.device)
        rec = state.cache.recurrent[self.state_layer, slots].to(like.device)
        conv = conv.masked_fill(fresh[:, None, None], 0.0)
        rec = rec.masked_fill(fresh[:, None, None, None], 0.0)
        return conv, rec
