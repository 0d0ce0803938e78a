"""At attach, before any hook: the vocab sizes and their audit, where the real vocab comes
from, the embedding and head discovery, a vocab-parallel head's shard; guard/weights/ asks two
of its pure helpers again at each read (`weight_shape`, `held_block`). The files a checkpoint
directory holds are read in guard/checkpoint/."""

__all__: list[str] = []
