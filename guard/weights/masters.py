"""Where the update reads a weight from besides the weight itself, so that a repair lasts. An
optimizer that keeps its own fp32 copy of the weights (DeepSpeed's ZeRO 1-3) updates that copy
and writes it back over the model's weights after each step: a repair written to the weight
alone is undone at the next update. So after a repair writes rows of a weight, the same values
go into the master copy this rank holds and the optimizer's moments of those elements are
zeroed (the garbage rows' history must not push them back). Found from the parameter at each
write, never kept: the guard may attach before `deepspeed.initialize` makes the copies.

- ZeRO-1/2 (`param._hp_mapping`): the model's weight is whole on every rank, its fp32 fragment
  covers elements [lp_fragment_address.start, + numel) of the flattened weight, and the moments'
  fragments are `optim_fragment` (made at the first step);
- ZeRO-3 (`ds_id`): the fp32 partition and its moments are laid out as `ds_tensor` is
  (`_z3_optimizer.get_local_fp32_param(param[, key])`);
- a torch optimizer that updates the parameter itself: its state's tensors of the weight's
  shape (Adam's `exp_avg`, `exp_avg_sq`, SGD's momentum) have those rows zeroed.
Anything else (an optimizer that updates tensors that are not the weight, with no mapping the
guard can follow) is `unreachable`: attach says so and the repair falls back to the mask."""

from __future__ import annotations

from typing import Any

import torch

from guard.weights.rows import holding_of
from guard.weights.zero_rows import ZeroRows

__all__ = ["Masters"]


def _zeroed(moments: dict[str, Any], like: torch.Tensor) -> list[torch.Tensor]:
    return [v for v in moments.values() if isinstance(v, torch.Tensor) and v.shape == like.shape]


def _put(target: torch.Tensor, value: torch.Tensor | float, ok: torch.Tensor | None) -> None:
    """`target` set to `value` where `ok` (0-dim bool on the device) holds: no host read."""
    new = torch.as_tensor(value, dtype=target.dtype, device=target.device).expand_as(target)
    target.copy_(new if ok is None else torch.where(ok.to(target.device), new, target))


class Masters:
    """The master copies of the weights `optimizer` (the torch optimizer the guard hooks, None
    without one) updates."""

    def __init__(self, optimizer: torch.optim.Optimizer | None) -> None:
        self.optimizer = optimizer

    def unreachable(self, weight: torch.Tensor) -> str | None:
        """Why a repair of `weight` would not last (None: it does)."""
        # ZeRO's copies are reached through DeepSpeed; FSDP2's DTensor: the shard is the weight.
        if self.optimizer is None or holding_of(weight) != "plain":
            return None
        if any(p is weight for g in self.optimizer.param_groups for p in g["params"]):
            return None
        return (f"{type(self.optimizer).__name__} does not update the weight itself (the "
                "tensors it steps are another copy the guard cannot map the rows to)")

    def written(self, weight: torch.Tensor, first: int, end: int,
                ok: torch.Tensor | None = None) -> None:
        """Rows [first, end) of `weight` were just written (the model's weight, or this rank's
        ZeRO-3 partition) where `ok` holds (a 0-dim bool on the device; None: they were): the
        same values into the master copy, their moments zeroed."""
        with torch.no_grad():
            held = holding_of(weight)
            if held == "zero3":
                self._zero3(weight, first, end, ok)
            elif held == "zero12":
                self._zero12(weight, first, end, ok)
            elif self.optimizer is not None and held == "plain":
                state = self.optimizer.state.get(weight, {})
                for m in _zeroed(state, weight):
                    _put(m[first:end], 0.0, ok)

    @staticmethod
    def _zero12(weight: torch.Tensor, first: int, end: int, ok: torch.Tensor | None) -> None:
        mapping: Any = getattr(weight, "_hp_mapping", None)
        if mapping is None:  # none of this weight is in this rank's partition
            return
        width = weight[0].numel() if weight.dim() > 1 else 1
        at, n = mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel
        s, e = max(first * width, at), min(end * width, at + n)
        if s >= e:
            return
        _put(mapping.hp_fragment[s - at : e - at], weight.detach().reshape(-1)[s:e], ok)
        for m in _zeroed(mapping.optim_fragment or {}, mapping.hp_fragment):
            _put(m[s - at : e - at], 0.0, ok)

    @staticmethod
    def _zero3(weight: torch.Tensor, first: int, end: int, ok: torch.Tensor | None) -> None:
        z3: Any = getattr(weight, "_z3_optimizer", None)
        if z3 is None:  # partitioned by zero.Init, no optimizer yet: the partition is all
            return
        rows = ZeroRows(weight)
        # The views themselves (get_local_fp32_param returns a copy where the optimizer's
        # states are offloaded to another device than the model's).
        hp, group = z3._get_fp32_opt_state_partition(weight, release_swap_buffers=False)
        for lp, master in zip(rows.pieces(rows.local(), first, end),
                              rows.pieces(hp, first, end), strict=True):
            _put(master.t, lp.t, ok)
        state = z3.optimizer.state.get(z3.fp32_partitioned_groups_flat[group], {})
        for key in [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim()]:
            moment, _ = z3._get_fp32_opt_state_partition(weight, release_swap_buffers=False,
                                                         optim_state_key=key)
            for p in rows.pieces(moment, first, end):
                _put(p.t, 0.0, ok)
