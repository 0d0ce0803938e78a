"""A weight's rows under every sharding, at attach and before each read (never in a hook):
one `Rows` interface made by one factory (`rows.py`'s `rows_of`) for a plain tensor, FSDP2's
row shards and a DTensor (`sharded.py`), DeepSpeed ZeRO-3's partitions (`zero_rows.py`); the
embedding's and the head's weights, each once (`vocab.py`); the features the untrained rows'
rules read (`features.py`); and where a repair writes besides the weight, the optimizer's
master copy (`masters.py`). Called by the stateful checks' device code (guard/device/rows.py,
untrained_tables.py) and their states (guard/stateful/).
"""

__all__: list[str] = []
