"""logitguard: a training-time guardrail for the vocabulary of language models."""

from guard.attach import Guard, attach, audit
from guard.checks import padding_mass
from guard.errors import AttachError, GuardError, GuardViolation, PolicyError
from guard.policy import Policy, load_policy
from guard.vocab import Audit, pad_vocab_size

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
