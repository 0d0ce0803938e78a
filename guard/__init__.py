"""logitguard: a training-time guardrail for the vocabulary of language models.

The names are resolved on first use (PEP 562), so `guard serve` and `guard audit`, which live
in this package, start without importing torch.
"""

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING

if _TYPE_CHECKING:
    from guard.device.checks import padding_mass
    from guard.errors import AttachError, GuardError, GuardViolation, PolicyError
    from guard.guard import Guard, attach
    from guard.policy import Policy
    from guard.policy_file import load_policy
    from guard.vocab.discover import audit
    from guard.vocab.sizes import Audit, pad_vocab_size

__all__ = [
    "AttachError",
    "Audit",
    "Guard",
    "GuardError",
    "GuardViolation",
    "Policy",
    "PolicyError",
    "attach",
    "audit",
    "load_policy",
    "pad_vocab_size",
    "padding_mass",
]

_WHERE = {
    "AttachError": "guard.errors",
    "Audit": "guard.vocab.sizes",
    "Guard": "guard.guard",
    "GuardError": "guard.errors",
    "GuardViolation": "guard.errors",
    "Policy": "guard.policy",
    "PolicyError": "guard.errors",
    "attach": "guard.guard",
    "audit": "guard.vocab.discover",
    "load_policy": "guard.policy_file",
    "pad_vocab_size": "guard.vocab.sizes",
    "padding_mass": "guard.device.checks",
}


def __getattr__(name: str) -> object:
    if name not in _WHERE:
        raise AttributeError(f"module 'guard' has no attribute {name!r}")
    value = getattr(_importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # once: later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
