"""Where the logits the loss sees come out. Most models hand the lm_head's output to their loss
as it is, and the guard measures and masks it in the head's forward hook. Some change it after
the head: Gemma-2/3's softcap `tanh(x / c) * c`, Cohere's `logit_scale`, Granite's
`logits_scaling`. There a mask at the head comes out of a softcap as -c, a finite logit, and
the mass measured at the head is not the loss's. For those, the guard measures and masks what
the model hands its HF `loss_function` (or, when the loss is computed outside the model, the
output's logits): the logits the loss uses."""

from __future__ import annotations

import inspect
import logging
from typing import Any, Literal

import torch
from torch import nn

from guard.device.compile import compiling
from guard.device.dtensors import mask_columns
from guard.device.hooks import Handle, wrap_loss
from guard.device.logits import Logits, ProbeConfig
from guard.vocab.real import config_levels

__all__ = ["LogitsSite", "Where", "changed", "find_logits", "find_loss", "loss_owner",
           "replace_logits", "transform_of"]

# head: measured and masked at the lm_head's output; loss: where the loss receives them.
Where = Literal["head", "loss"]

_CHANGED = ("the model changes its logits after the head before its loss: from the next "
            "step the padding mass is measured, and the mask applied, in {where} (this step's "
            "mass was measured at the head)")

# Config attributes by which HF models change the logits after the head, and their neutral
# value (the transform is off at it).
_TRANSFORMS: dict[str, float | None] = {
    "final_logit_softcapping": None,  # Gemma-2/3/3n/4, nanochat: tanh(x / c) * c
    "logit_scale": 1.0,  # Cohere, Cohere-2: x * s
    "logits_scaling": 1.0,  # Granite and its MoE variants: x / s
}


def transform_of(model: nn.Module) -> str | None:
    """The config attribute (`config.<name>` = value) by which `model` changes its logits after
    the head, when it is one the guard knows; None otherwise."""
    for prefix, cfg in config_levels(getattr(model, "config", None)):
        for name, neutral in _TRANSFORMS.items():
            v = getattr(cfg, name, None)
            if isinstance(v, int | float) and not isinstance(v, bool) and v not in (0, neutral):
                return f"{prefix}.{name} = {v}"
    return None


def loss_owner(model: nn.Module) -> nn.Module | None:
    """The outermost module whose HF `loss_function` (a property with a setter) computes the
    loss from the final logits: the guard wraps it while attached."""
    for m in model.modules():
        prop = inspect.getattr_static(type(m), "loss_function", None)
        if isinstance(prop, property) and prop.fset is not None:
            return m
    return None


def find_loss(output: Any) -> torch.Tensor | None:
    """The scalar loss in a model's output: HF `.loss`, a dict's 'loss', nanoGPT's tuple, or
    the output itself when it is a 0-dim float tensor."""
    cand = output if isinstance(output, torch.Tensor) else getattr(output, "loss", None)
    if cand is None and isinstance(output, dict):
        cand = output.get("loss")
    if cand is None and isinstance(output, tuple | list):
        cand = next((o for o in output if isinstance(o, torch.Tensor) and o.dim() == 0), None)
    if isinstance(cand, torch.Tensor) and cand.dim() == 0 and cand.is_floating_point():
        return cand
    return None


def find_logits(output: Any, columns: int) -> torch.Tensor | None:
    """The (..., columns) logits in a model's output: HF `.logits`, a dict's 'logits', or the
    first such tensor of a tuple (nanoGPT's `(logits, loss)`)."""
    cand = getattr(output, "logits", None)
    if cand is None and isinstance(output, dict):
        cand = output.get("logits")
    if cand is None and isinstance(output, tuple | list):
        cand = next((o for o in output if isinstance(o, torch.Tensor) and o.dim() >= 2
                     and o.shape[-1] == columns), None)
    if isinstance(cand, torch.Tensor) and cand.dim() >= 2 and cand.shape[-1] == columns:
        return cand
    return None


def changed(logits: torch.Tensor, head_outs: list[torch.Tensor]) -> bool:
    """`logits` are not one of this forward's head outputs as it came out (several: torchtune's
    chunked output calls the head per chunk): another tensor, and not a cast of one (HF losses
    upcast; older models returned `logits.float()`). Identity and dtype only: no tensor value
    is read. False when the head was not called."""
    if not head_outs:
        return False
    return not any(logits is h or (logits.dtype != h.dtype and logits.shape == h.shape)
                   or _alias(logits, h) for h in head_outs)


def _alias(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same values under another tensor object: an identity autograd function between the
    head and the loss (DeepSpeed ZeRO-3 passes every module's output through one, after hooks
    registered before it). Storage metadata only; never while compiling (fake tensors)."""
    if compiling():
        return False
    return a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride() and \
        a.data_ptr() == b.data_ptr()


def replace_logits(output: Any, old: torch.Tensor, new: torch.Tensor | None) -> Any:
    """`output` with `new` in place of its logits `old`, for a forward hook to return; None
    (keep the output) when they are the same tensor (an in-place mask)."""
    if new is None or new is old:
        return None
    if isinstance(output, dict):  # HF ModelOutput is an OrderedDict: item and attribute
        output["logits"] = new
        return output
    if isinstance(output, tuple | list):
        return type(output)(new if o is old else o for o in output)
    return None


class LogitsSite:
    """Per forward, the logits the loss sees: measured there (in training) into the flags, and
    masked there under `mask`. The probe's head and model hooks, and the model's loss
    function, hand it what they see; it never reads a tensor to the host."""

    def __init__(self, cfg: ProbeConfig, logits: Logits) -> None:
        self.cfg, self.logits = cfg, logits
        self.where: Where = "head"
        # What the host logs at the next boundary (level, text): never from inside a hook.
        self.notes: list[tuple[int, str]] = []
        self._training = False
        self._head_outs: list[torch.Tensor] = []  # this forward's head outputs, as the model
        # goes on with them
        # The logits the loss function was given, and as the guard handed them on (None: no
        # loss function call this forward).
        self._at_loss: tuple[torch.Tensor, torch.Tensor] | None = None
        self._told = False  # logits changed after the head outside any loss site: said once

    def install(self, model: nn.Module, head_name: str) -> list[Handle]:
        """Wrap the model's HF loss function, if it has one; a transform known from the
        config puts the site there from the first step."""
        owner = loss_owner(model)
        if owner is None:
            return []
        if (how := transform_of(model)) is not None:
            self.where = "loss"
            self.notes.append((logging.INFO, (
                f"the model changes its logits after {head_name} ({how}): the padding "
                "mass is measured, and the mask applied, in the logits its loss function "
                "receives")))
        return [wrap_loss(owner, self.at_loss)]

    def begin(self, training: bool) -> None:
        """A forward of the model starts."""
        self._training, self._head_outs, self._at_loss = training, [], None

    def at_head(self, logits: torch.Tensor, training: bool) -> torch.Tensor | None:
        """The head's output: measured and masked here unless the loss sees other logits; what
        a forward hook returns (None: keep the output)."""
        masked = None if self.where == "loss" else self._measure_and_mask(logits, training)
        self._head_outs.append(logits if masked is None else masked)
        return masked

    def at_part(self, columns: torch.Tensor, logits: torch.Tensor, real: int,
                training: bool) -> torch.Tensor | None:
        """A vocab-parallel head's output of which `columns` are this rank's (a DTensor's
        local part, or a slice of every column gathered on every rank): measured there,
        masked in `logits` from its local column `real` on."""
        if training:
            with torch.no_grad():
                self.logits.measure(columns.detach())
        masked = mask_columns(logits, real) if self.cfg.mask else None
        self._head_outs.append(logits if masked is None else masked)
        return masked

    def at_loss(self, logits: Any) -> Any:
        """The logits the model hands its HF loss function (hooks.wrap_loss)."""
        if not isinstance(logits, torch.Tensor) or logits.shape[-1] != self.cfg.columns:
            return logits
        if self.where == "head":
            if not (self._training and changed(logits, self._head_outs)):
                return logits  # the head's output, measured and masked at the head
            # Changed after the head by a transform the guard did not know: from the next
            # forward on it is measured here; this one was measured at the head, and is masked
            # here too so that no -inf comes out of the transform finite.
            self.where = "loss"
            self.notes.append((logging.WARNING, _CHANGED.format(
                where="the logits its loss function receives")))
            masked = self._mask(logits)
        else:
            masked = self._measure_and_mask(logits, self._training)
        out = logits if masked is None else masked
        # The model returns the tensor it gave its loss: where the mask is not in place (a
        # compiled forward's functional mask), the output gets the masked one too.
        self._at_loss = (logits, out)
        return out

    def at_output(self, output: Any, training: bool) -> Any:
        """The model's output: what a forward hook returns (None: keep it)."""
        head_outs, self._head_outs = self._head_outs, []
        at_loss, self._at_loss = self._at_loss, None
        out = find_logits(output, self.cfg.columns) if head_outs else None
        if at_loss is not None:
            given, masked = at_loss
            return replace_logits(output, given, masked) if out is given else None
        if out is not None and self.where == "loss":
            # The loss function was not called (no labels: the loss is computed outside the
            # model, or this is generation): the output's logits are what a loss will see.
            return replace_logits(output, out, self._measure_and_mask(out, training))
        if out is not None and training and changed(out, head_outs):
            return self._changed_outside(output, out)
        return None

    def _changed_outside(self, output: Any, out: torch.Tensor) -> Any:
        """The output's logits are not the head's, and no loss function saw them."""
        if find_loss(output) is None:
            # The loss will be computed outside the model, from these: measured and masked
            # here from the next forward on (and masked now, before that loss).
            self.where = "loss"
            self.notes.append((logging.WARNING, _CHANGED.format(
                where="the logits the model returns")))
            return replace_logits(output, out, self._mask(out))
        if not self._told:
            self._told = True
            self.notes.append((logging.INFO, (
                "the model changes its logits after the head and computes its loss "
                "inside forward, where the guard cannot reach it: the padding mass is measured "
                "and masked at the head's output (a mask survives an added bias or a positive "
                "scale, not a softcap)")))
        return None

    def _measure_and_mask(self, logits: torch.Tensor, training: bool) -> torch.Tensor | None:
        """Measure (in training) the logits the loss will see, then mask them."""
        if training:
            with torch.no_grad():
                self.logits.measure(logits.detach())
        return self._mask(logits)  # after measuring: the mass reported is the one it removed

    def _mask(self, logits: torch.Tensor) -> torch.Tensor | None:
        return mask_columns(logits, self.cfg.real_columns) if self.cfg.mask else None
