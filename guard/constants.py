"""Numbers that more than one part of the guard reads, each with where it comes from. Imports
nothing: the policy takes its defaults from here, and `guard audit` reads the same numbers
without torch or the server's wire (guard/checkpoint/untrained_rules.py)."""

from __future__ import annotations

__all__ = ["DUPLICATES", "EPSILON", "MAX_EPSILON", "MAX_IDS", "NORM_RATIO"]

# Token ids are unsigned 32-bit in the tokenizers library and in every checkpoint format read
# (guard/checkpoint/tokenizer_files.py): a vocabulary has at most this many ids, a weight as many
# rows that matter.
MAX_IDS = 2**32

# -- untrained_rows: when a row of the real vocab counts as never trained ---------------------
# The rules themselves: guard/checkpoint/untrained_rules.py; the measurements: docs/checks.md.

# Unsloth's bound (fix_untrained_tokens). Llama-3 base's reserved rows hold 0, or ~1e-23 in
# bfloat16 (it keeps float32's exponent); a trained row's values are 1e-3..1, and no optimizer
# update leaves a value under 1e-16.
EPSILON = 1e-16
# The policy's largest: far below a trained row's values (1e-3..1), so no trained row is ever
# all under it; an epsilon near 1 would "repair" every row.
MAX_EPSILON = 1e-6
# A never-seen row that weight decay shrank but left above EPSILON (0.1 decay at lr 3e-4 takes
# a row to 1e-3 of its init in 230k steps). Healthy rows measured 0.6-1.6x the median (a normal
# init, rows trained on Zipf ids), the trained mean a repair writes 0.1x, a decayed row 1e-4x
# (bench/untrained_norms.py).
NORM_RATIO = 1e-3
# Placeholders (Llama-3.1's head rows of its reserved tokens are one vector repeated): rows
# that trained never coincide bit for bit.
DUPLICATES = 2
