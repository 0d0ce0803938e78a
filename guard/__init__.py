"""logitguard: a training-time guardrail for the vocabulary of language models.

The names are resolved on first use (PEP 562), so `guard serve` and `guard audit`, which live
in this package, start without importing torch.
"""

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING

if _TYPE_CHECKING:
    from guard.device.frozen import FrozenMask, mask_frozen
    from guard.device.loss import LossShares
    from guard.device.ops import mask_padding, padding_mass
    from guard.errors import AttachError, GuardError, GuardViolation, PolicyError, StateError
    from guard.guard import Guard, attach
    from guard.policy import Policy
    from guard.policy_file import load_policy
    from guard.step.clock import Steps
    from guard.step.optimizers import torch_optimizer
    from guard.vocab.discover import Heads, find_heads
    from guard.vocab.resolve import audit
    from guard.vocab.sizes import Audit, pad_vocab_size

__all__ = [
    "AttachError",
    "Audit",
    "FrozenMask",
    "Guard",
    "GuardError",
    "GuardViolation",
    "Heads",
    "LossShares",
    "Policy",
    "PolicyError",
    "StateError",
    "Steps",
    "attach",
    "audit",
    "find_heads",
    "load_policy",
    "mask_frozen",
    "mask_padding",
    "pad_vocab_size",
    "padding_mass",
    "torch_optimizer",
]

_WHERE = {
    "AttachError": "guard.errors",
    "Audit": "guard.vocab.sizes",
    "FrozenMask": "guard.device.frozen",
    "Guard": "guard.guard",
    "GuardError": "guard.errors",
    "GuardViolation": "guard.errors",
    "Heads": "guard.vocab.discover",
    "LossShares": "guard.device.loss",
    "Policy": "guard.policy",
    "PolicyError": "guard.errors",
    "StateError": "guard.errors",
    "Steps": "guard.step.clock",
    "attach": "guard.guard",
    "audit": "guard.vocab.resolve",
    "find_heads": "guard.vocab.discover",
    "load_policy": "guard.policy_file",
    "mask_frozen": "guard.device.frozen",
    "mask_padding": "guard.device.ops",
    "pad_vocab_size": "guard.vocab.sizes",
    "padding_mass": "guard.device.ops",
    "torch_optimizer": "guard.step.optimizers",
}


def __getattr__(name: str) -> object:
    if name not in _WHERE:
        raise AttributeError(f"module 'guard' has no attribute {name!r}")
    value = getattr(_importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # once: later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
