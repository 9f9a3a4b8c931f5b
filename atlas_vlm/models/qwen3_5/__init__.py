"""Qwen3.5 (HF ``qwen3_5``): the hybrid decoder (Gated DeltaNet + gated full attention,
``model.py``, ``gated_deltanet.py``), its vision tower (``vision.py``: Qwen3-VL's without
DeepStack), its hooks and size counts (``family.py``, ``param_count.py``). Media inputs are
Qwen3-VL's (``models.qwen3_vl.inputs.Qwen3VLInputs``: HF gives Qwen3.5 the same processor and
``get_rope_index``)."""
