"""At attach, before any hook: the vocab sizes and their audit, where the real vocab comes
from, the embedding and head discovery; and the audit of a checkpoint directory with the
untrained rows' rules it shares with attach (pure Python, no torch)."""

__all__: list[str] = []
