"""Checks of the quantized matmul kernel's engine runs against its own definition
(``_QuantLinear.kernel_reference``): a recorder of every quantized linear call, the switch of
every forward to the definition, and where two runs' int8 activations part at a rounding tie.
Used by tests/parity/test_quantized_load.py, test_awq_gptq.py and test_quantized_vlm.py."""

from __future__ import annotations

import torch


KERNEL_DEFINITION_ATOL = 1e-4  # fp32 logits: kernel run vs the same model run through kernel_reference
KERNEL_CALL_REL = 5e-6  # one call: max |kernel - kernel_reference| / max |kernel_reference|, same input
TIE_SLACK = 1e-3  # an activation that rounds one way in one run and the other way in the other: this near .5


def as_kernel_definition(monkeypatch) -> None:
    """For the rest of the test, every quantized linear's ``forward`` is ``kernel_reference``:
    the kernel's own definition in PyTorch ops (activations quantized as the kernel does, exact
    int sums as fp32 over the dequantized weight). Load a fresh engine after it (a kernel run's
    cached prefix would mix the two)."""
    from atlas_vlm.layers import quant_linear

    monkeypatch.setattr(quant_linear._QuantLinear, "forward", quant_linear._QuantLinear.kernel_reference)


class QuantCalls:
    """Context manager recording every quantized linear call of ``llm``'s model, in order:
    ``codes[i]`` / ``scaled[i]`` the call's activations as the kernel quantizes them (per block
    of 32, ``x / d`` before and after rounding), ``step_ends`` the number of calls after each
    engine step; with ``check`` also ``worst_rel``, the largest ``max |out - ref| / max |ref|``
    of a call against ``kernel_reference`` on the same input (a kernel run: its own definition,
    so no rounding can part them there)."""

    def __init__(self, llm, check: bool):
        from atlas_vlm.layers.quant_linear import quantized_modules

        self.runner, self.check = llm.engine.runner, check
        self.modules = quantized_modules(self.runner.model)
        self.codes: list[torch.Tensor] = []
        self.scaled: list[torch.Tensor] = []
        self.step_ends: list[int] = []
        self.worst_rel = 0.0

    def _hook(self, mod, inputs, out) -> None:
        x = inputs[0].detach().reshape(-1, mod.in_features).float()
        xb = x.view(x.shape[0], -1, 32)
        d = xb.abs().amax(-1, keepdim=True) / 127.0
        v = xb * torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        self.scaled.append(v)
        self.codes.append(torch.round(v))
        if self.check:
            ref = mod.kernel_reference(inputs[0]).float()
            self.worst_rel = max(self.worst_rel, ((out.float() - ref).abs().max() / ref.abs().max()).item())

    def _observe(self, *args) -> None:
        self.step_ends.append(len(self.codes))

    def __enter__(self) -> QuantCalls:
        # The one-call decode step runs the kernel without the modules' forward (no hook sees it,
        # and kernel_reference cannot stand in for it): these runs go op by op. That step has the
        # op-by-op bits (tests/parity/test_decode_step.py).
        self.decode_step, self.runner.decode_step = self.runner.decode_step, None
        self.handles = [m.register_forward_hook(self._hook) for m in self.modules]
        self.runner.observers.append(self._observe)
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.runner.observers.remove(self._observe)
        self.runner.decode_step = self.decode_step


def steps_before_rounding_tie(a: QuantCalls, b: QuantCalls) -> int:
    """Engine steps two runs took with the same int8 activations in every call: all, or those
    before the first call where an activation rounds differently. That one is asserted to be a
    tie: codes one apart, both values within ``TIE_SLACK`` of the same ``.5`` (fp32 summation
    order upstream, ~1e-7, decides it; the runs then part legitimately)."""
    assert a.step_ends == b.step_ends and len(a.codes) == len(b.codes)
    for i, (ca, cb) in enumerate(zip(a.codes, b.codes)):
        if not torch.equal(ca, cb):
            flip = ca != cb
            va, vb = a.scaled[i][flip], b.scaled[i][flip]
            assert ((ca[flip] - cb[flip]).abs() == 1).all() and ((va - vb).abs() <= TIE_SLACK).all(), (va, vb)
            assert ((va.abs().frac() - 0.5).abs() <= TIE_SLACK).all(), (va, vb)
            return sum(end <= i for end in a.step_ends)
    return len(a.step_ends)
