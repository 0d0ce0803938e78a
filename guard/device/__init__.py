"""The device side: the tensors the guard computes with, on the device. Inside the forward and
optimizer hooks every step (the probe and its hooks, the ids, the logits, the loss, the one
flags vector), and the reductions over the embedding's and head's weights that the stateful
checks (guard/stateful/) make at attach and before each read (their rows, row shards).

Nothing in this folder reads a tensor to the host (tests/guard/device/test_hot_path.py checks
every file); the one read, at a step boundary, is `Flags._wait`.
"""

__all__: list[str] = []
