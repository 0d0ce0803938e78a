"""guard audit and attach's tokenizer discovery: untrusted files read by their libraries; no torch.

A checkpoint directory's files (config.json, the tokenizer files, a sentencepiece model, the
safetensors headers and rows) are read here, each within a bound (`files.py`, `read_limits.py`),
with the untrained rows' rules that `guard audit` shares with attach (`untrained_rules.py`).
Run by `guard audit` (guard/checkpoint_audit.py) and at attach, before any hook, where the real
vocab is read from the tokenizer files (guard/vocab/real.py, guard/stateful/untrained_rows.py).
Nothing here imports torch (tests/guard/checkpoint/test_room.py).
"""

__all__: list[str] = []
