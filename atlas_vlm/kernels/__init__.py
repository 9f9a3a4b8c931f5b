"""The CPU kernels in C and their Python wrappers, in one room: the build (``cbuild``: flags
from the detected CPU, compiled on first use, cached by source hash), the variants each kernel
is built in (AVX512-VNNI / AVX2(+AVX-VNNI) / plain C), and the fallbacks (PyTorch references
with the same answer) used where a kernel cannot build or the CPU lacks what it needs.

- ``decode_kernel``: paged decode attention straight from KV blocks (``csrc/paged_decode.c``);
- ``quant_kernel``: the int4 / int8 tile matmul (``csrc/quant_gemm.c``);
- ``fused``: RMSNorm + residual, SwiGLU, q/k norm + RoPE + K/V write (``csrc/fused_ops.c``);
- ``decode_step``: a quantized model's decode step, every layer in one call (``csrc/decode_step.c``),
  over tensors (``worker.decode_step`` walks the model for them);
- ``gated_delta``: a Gated DeltaNet layer's decode token (conv1d state shift, q/k L2-norm, the
  gated delta rule on the state slots in place; ``csrc/gated_delta.c``).

The modules that use them (``layers/``, ``models/``, ``worker/``) stay free of C. The kernels take
tensors and plain values only: nothing here imports ``layers/`` or ``models/``
(``tests/test_import_graph.py``).
"""
