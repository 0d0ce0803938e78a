"""At attach and in `guard audit`: the one table of names a model's output head goes by, shared
by discovery (module names) and the checkpoint audit (tensor names); pure Python, no torch."""

from __future__ import annotations

__all__ = ["HEAD_NAMES", "NESTED_HEADS"]

# In discovery's order of preference: lm_head almost everywhere, output in original Llama,
# head / output_layer / cls in custom and Megatron-style models, embed_out in GPT-NeoX.
HEAD_NAMES = ("lm_head", "output", "head", "output_layer", "embed_out", "cls")
# The names distinctive enough for the audit to match at any depth of a checkpoint's tensor
# names; the others only at the top level (`output.weight`, `head.weight`), where no
# attention or classifier block of the same name can be mistaken for the head.
NESTED_HEADS = ("lm_head", "embed_out")
