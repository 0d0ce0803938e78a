"""The token ids of a training forward, as the hooks see them: the input ids, in a pre-hook on
every module that embeds with the embedding's weight, and the labels, in the model's pre-hook
(`labels=` / `targets=`, or their position in its forward: guard/device/labels.py). token_range
checks both; a stateful check may count them too (untrained_rows, through the states'
`Watched`). Device ops only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from guard.checks import coverage, token_range
from guard.device.compile import compiling
from guard.device.dtensors import local, rewrap
from guard.device.flags import Flags
from guard.device.hooks import Handle, hook
from guard.device.id_ops import flat_positions, out_of_range_parts, within_rows
from guard.device.labels import LabelsArg
from guard.device.logits import ProbeConfig
from guard.device.watched import Watched
from guard_server.wire import ID_KINDS, IdKind

__all__ = ["IdHooks"]


class IdHooks:
    """What the id hooks do with the ids: count them for the states that watch them, check
    them for token_range, and replace those with no row before they index out of bounds."""

    def __init__(self, cfg: ProbeConfig, flags: Flags, states: Watched | None = None) -> None:
        self.cfg, self.flags, self._states = cfg, flags, states
        # Per kind of id, whether a state counts it (none: the hook asks nothing of them).
        self._counted = {k: states is not None and states.watches(k) for k in ID_KINDS}
        self.labels_arg = LabelsArg(None, "forward")  # set at install, from the model
        self._positions: torch.Tensor | None = None  # `_held_positions`

    def install(self, caller: nn.Module, model: nn.Module,
                inputs: Sequence[nn.Module]) -> list[Handle]:
        """A pre-hook on each module of `inputs` (those that embed with the embedding's weight)
        where the input ids are needed; the labels are the model pre-hook's (`labels`), found
        in the calls of `caller` by `model`'s own forward when `caller` names none."""
        self.labels_arg = LabelsArg.of(caller, model)
        if not (self.cfg.token_range or self._counted["input"]):
            return []
        return [hook(m, self._embedding_pre, kind="forward_pre") for m in inputs]

    def _embedding_pre(self, module: nn.Module, args: tuple[Any, ...]) -> Any:
        if not (module.training and args and isinstance(args[0], torch.Tensor)):
            return None
        given = args[0]
        ids = local(given)  # tensor parallel's embedding plans hand it a DTensor of global ids
        if ids.is_floating_point():  # embeddings of something else
            return None
        if self._counted["input"] and self._states is not None:
            self._states.count("input", ids)
        if not self.cfg.token_range:
            return None
        self.flags.mark(coverage.SEEN["inputs"])
        with torch.no_grad():
            self._out_of_range("input", ids, None)
            # An id with no row would end the step in an index error (on a GPU, a device-side
            # assert that kills the process) before the guard could say anything: it is
            # replaced by id 0 and counted, and the read says where it was.
            safe = within_rows(ids, self.cfg.input_rows, 0)
        return (rewrap(given, safe), *args[1:])

    def labels(self, training: bool, args: tuple[Any, ...], kwargs: dict[str, Any], *,
               fused: bool) -> Any:
        """In the model's pre-hook: its labels counted and checked in a training forward, and
        made safe (also for a fused head handed the real rows, `fused`); the new (args,
        kwargs), or None to leave them."""
        counting = training and self._counted["label"]
        checked = training and self.cfg.token_range
        if not (checked or fused or counting):
            return None
        at, given = self.labels_arg.find(args, kwargs)
        if not isinstance(given, torch.Tensor) or given.is_floating_point():
            return None
        safe = self._label_ids(given, counting, checked=checked, fused=fused)
        if safe is None:
            return None
        if isinstance(at, str):
            return args, {**kwargs, at: safe}
        if isinstance(at, int):
            return (*args[:at], safe, *args[at + 1:]), kwargs
        return None

    def target(self, given: Any) -> Any:
        """A pipeline schedule's target, the labels of the last stage outside any forward:
        counted and checked as labels (a training step's), and returned made safe."""
        if not isinstance(given, torch.Tensor) or given.is_floating_point():
            return given
        safe = self._label_ids(given, self._counted["label"], checked=self.cfg.token_range,
                               fused=False)
        return given if safe is None else safe

    def _label_ids(self, given: torch.Tensor, counting: bool, *, checked: bool,
                   fused: bool) -> torch.Tensor | None:
        """The labels counted (`counting`), checked (`checked`) and made safe; None: left as
        they are."""
        labels = local(given)
        if counting and self._states is not None:
            self._states.count("label", labels)
        if not (checked or fused):
            return None
        ignore = self.cfg.ignore_index
        with torch.no_grad():
            if checked:
                self.flags.mark(coverage.SEEN["labels"])
                self._out_of_range("label", labels, ignore)
            # As the embedding's ids: a label past the rows, which the loss would index out of
            # bounds, becomes the ignore index (torch's and HF's -100 where the policy has
            # none), counted above; with the fused head cut to the real rows, a label past
            # them. Negative labels stay: they are the loss's own ignore value (HF -100,
            # nanoGPT -1), or a setting the message names.
            return rewrap(given, within_rows(labels, self.cfg.real if fused else self.cfg.rows,
                                             -100 if ignore is None else ignore,
                                             negative=False))

    def _out_of_range(self, kind: IdKind, ids: torch.Tensor, ignore_index: int | None) -> None:
        n, negative, top = out_of_range_parts(ids, self.cfg.real, ignore_index,
                                              self._held_positions(ids))
        f = self.flags
        f.put(token_range.SLOTS[kind], n)
        if kind == "label":
            f.put(token_range.NEGATIVE, negative)
        f.put(token_range.TOP[kind], top)
        f.put(token_range.WIDTH[kind], ids.shape[-1] if ids.dim() else 0)

    def _held_positions(self, ids: torch.Tensor) -> torch.Tensor | None:
        """The flat positions of `ids`' keys, kept from forward to forward (the largest
        forward's, sliced): two small ops a check fewer. None under torch.compile (made in
        the graph, where the compiler fuses them)."""
        if compiling():
            return None
        held = self._positions
        if held is None or held.device != ids.device or held.numel() < ids.numel():
            held = self._positions = flat_positions(ids.numel(), ids.device)
        return held
