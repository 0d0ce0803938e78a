"""The vocab layout of the guarded heads at attach: whether the head's columns are a shard of
the vocab and which one, read from the head where it says (a DTensor's placement, Megatron's
attributes), else from `vocab_shard=`; the same for the embedding's rows; the tensor-parallel
degree the alignment check asks for. Anything the guard cannot place is an AttachError that
says what to pass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from guard.errors import AttachError
from guard.quote import quote
from guard.tensors import dtensor_of
from guard.vocab import megatron
from guard.vocab.discover import Heads
from guard.vocab.parallel import VocabShard, fsdp_managed, held_block, tp_dims
from guard.vocab.sizes import shard_sizes

__all__ = ["Layout", "layout_of", "placed"]

# What a process group is, for the messages: the third element of vocab_shard=.
_GROUP_HINT = ("vocab_shard=(start, end, tp_group), tp_group the torch.distributed process "
               "group of the ranks that hold the other shards")


@dataclass(frozen=True)
class Layout:
    """The heads' rows in the whole vocab on this rank."""

    head: VocabShard | None  # the head's columns, when they are a shard of the vocab
    embedding: VocabShard | None  # the embedding's rows, when a plain tensor holds a shard
    tensor_parallel: int  # what the alignment check multiplies pad_multiple by
    rows: int  # of the whole head
    embedding_rows: int  # of the whole embedding

    def first_padding(self, real: int) -> tuple[int, int]:
        """The first padding row of the embedding's weight and the head's, in their own row
        numbers: a DTensor's are global, a plain shard's its own."""
        out = []
        for shard, rows in ((self.embedding, self.embedding_rows), (self.head, self.rows)):
            if shard is None or shard.dtensor:
                out.append(min(real, rows))
            else:
                out.append(min(max(real - shard.start, 0), shard.width))
        return out[0], out[1]


def _dtensor_shard(module: nn.Module, name: str, model: nn.Module) -> VocabShard | None:
    """The shard of a module whose weight is a DTensor split by rows on a tensor-parallel mesh
    dim; None when it is replicated, or split by FSDP2 only (gathered in forward)."""
    weight = dtensor_of(getattr(module, "weight", None))
    if weight is None:
        return None
    dims = tp_dims(tuple(weight.placements), fsdp_managed(model, name))
    if not dims:
        return None
    mesh, rows = weight.device_mesh, int(weight.shape[0])
    if len(dims) > 1:
        raise AttachError(
            f"{name}.weight is split by rows over mesh dims {list(dims)} (placements "
            f"{tuple(weight.placements)}): the guard reads a vocab split over one "
            "tensor-parallel mesh dim; pass lm_head= / embedding= of a module split so")
    held = held_block(rows, weight, dims)
    if held is None:
        raise AttachError(
            f"{name}.weight: the rows this rank holds under placements "
            f"{tuple(weight.placements)} are not one block of the vocab, so its columns are "
            "no range of token ids; pass lm_head= / embedding= of a module split by blocks")
    dim = dims[0]
    names = mesh.mesh_dim_names
    label = f"mesh dim {names[dim]!r}" if names else f"mesh dim {dim}"
    return VocabShard(held[0], held[0] + held[1], rows, mesh.size(dim), mesh.get_group(dim),
                      f"a DTensor Shard(0) on {label}", dtensor=True)


def _megatron_shard(module: nn.Module) -> VocabShard | None:
    cols = megatron.columns_of(module)
    rows = megatron.rows_of(module)
    if cols is None or rows is None:
        return None
    start, end, group = cols
    _, degree = megatron.group_rank(group)
    if degree == 1:
        return None
    return VocabShard(start, end, rows, degree, group, f"Megatron's {type(module).__name__}")


def placed(module: nn.Module, name: str, model: nn.Module) -> VocabShard | None:
    """The shard of the vocab `module` holds as its own weight says (a DTensor split by rows
    on a tensor-parallel mesh dim, Megatron's attributes); None: whole, or not said."""
    return _dtensor_shard(module, name, model) or _megatron_shard(module)


def _group_for(vocab_shard: tuple[Any, ...], degree: int) -> Any:
    """The ranks of a hand-sharded head's other shards: given as vocab_shard's third element,
    else the whole world when it is the tensor-parallel degree, else Megatron's own group."""
    if len(vocab_shard) == 3:
        return vocab_shard[2]
    if not (dist.is_available() and dist.is_initialized()):
        return None  # one process: no other shard to combine with
    if dist.get_world_size() == degree:
        return dist.group.WORLD
    raise AttachError(
        f"vocab_shard={tuple(vocab_shard)} on rank {dist.get_rank()} of "
        f"{dist.get_world_size()} with vocab.tensor_parallel={degree}: the guard cannot tell "
        f"which ranks hold the other shards; pass {_GROUP_HINT}")


def _given(vocab_shard: tuple[Any, ...], heads: Heads, degree: int) -> VocabShard:
    if not isinstance(vocab_shard, tuple | list) or len(vocab_shard) not in (2, 3):
        raise AttachError(f"vocab_shard must be (start, end) or (start, end, tp_group), got "
                          f"{vocab_shard!r}")
    group = vocab_shard[2] if len(vocab_shard) == 3 else None
    if group is not None and not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        # Used at the first step's all-reduce: 'junk' there was an AttributeError mid-training.
        raise AttachError(f"vocab_shard's third element must be the torch.distributed process "
                          f"group of the ranks that hold the other shards (or None), got "
                          f"{quote(group)} ({type(group).__name__})")
    start, end = vocab_shard[0], vocab_shard[1]
    try:
        rows = shard_sizes((start, end), heads.head_rows, degree)
    except ValueError as e:
        raise AttachError(str(e)) from None
    return VocabShard(start, end, rows, degree, _group_for(tuple(vocab_shard), degree),
                      "vocab_shard=")


def _checked_against(found: VocabShard, vocab_shard: tuple[Any, ...] | None,
                     policy_tp: int, name: str) -> None:
    if vocab_shard is not None and tuple(vocab_shard[:2]) != (found.start, found.end):
        raise AttachError(
            f"vocab_shard={tuple(vocab_shard[:2])} disagrees with {name}: it is "
            f"{found.source}, whose columns here are the ids [{found.start}, {found.end}) of "
            f"{found.rows}; drop vocab_shard= (the guard reads it from the head)")
    if policy_tp not in (1, found.degree):
        raise AttachError(
            f"vocab.tensor_parallel: {policy_tp}, but {name} is {found.source} split over "
            f"{found.degree} ranks; set vocab.tensor_parallel: {found.degree} or leave it out")


def layout_of(heads: Heads, model: nn.Module | None, vocab_shard: tuple[Any, ...] | None,
              policy_tp: int) -> Layout:
    """The layout of `heads` in `model`; `vocab_shard` and the policy's tensor-parallel degree
    are checked against what the head says of itself."""
    where = model if model is not None else heads.lm_head
    head = placed(heads.head_holder, heads.lm_head_name, where)
    if head is not None:
        _checked_against(head, vocab_shard, policy_tp, heads.lm_head_name)
    elif vocab_shard is not None:
        head = _given(vocab_shard, heads, policy_tp)
    embedding = placed(heads.embedding, heads.embedding_name, where)
    if embedding is not None and embedding.dtensor:
        embedding = None  # its rows are read in global numbers, as a whole weight's
    elif embedding is None and head is not None and head.source == "vocab_shard=" \
            and heads.embedding_rows == heads.head_rows:
        embedding = head  # a hand-sharded embedding with as many rows: sharded alike
    degree = head.degree if head is not None else policy_tp
    rows = head.rows if head is not None else heads.head_rows
    embedding_rows = embedding.rows if embedding is not None else heads.embedding_rows
    return Layout(head, embedding, degree, rows, embedding_rows)
