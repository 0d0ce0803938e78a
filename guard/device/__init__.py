"""The device side: the tensors the guard computes with, on the device. Inside the forward and
optimizer hooks every step (the probe and its hooks, the ids, the logits, the loss, the one
flags vector), and the stateful checks' device code that writes the flags before each read
(the padding rows, the untrained rows' tables), which reads the weights through guard/weights/.

Nothing in this folder reads a tensor to the host (tests/guard/device/test_hot_path.py checks
every file); the one read, at a step boundary, is `Flags._wait`.
"""

__all__: list[str] = []
