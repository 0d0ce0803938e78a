"""At attach, before any hook: the vocab sizes and their audit, the embedding and head
discovery, and the audit of a checkpoint directory (pure Python, no torch)."""

__all__: list[str] = []
