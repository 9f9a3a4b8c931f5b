"""Structured output: grammars that constrain a request's tokens (JSON schema, regex,
choice, Lark), owned by the ``StructuredOutputManager`` beside the scheduler; the sampler
only applies the step's token bitmask."""

from atlas_vlm.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
