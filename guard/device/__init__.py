"""The device side: code that runs inside forward hooks and optimizer hooks, every step.

Nothing in this folder reads a tensor to the host (tests/guard/device/test_hot_path.py checks
every file); the one read, at a step boundary, is `Flags._wait`.
"""

__all__: list[str] = []
