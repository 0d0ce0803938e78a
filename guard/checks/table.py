"""The per-step checks, one spec each (guard/checks/<name>.py), in the order of a verdict:
cause first. A broken tie of embedding and head explains the rest; ghost ids explain an
infinite loss under the mask, not the reverse; ids on rows that were never trained explain a
NaN in half precision; a blind check explains a quiet one."""

from __future__ import annotations

import functools
from typing import Any

from guard.checks import (
    coverage,
    grads,
    loss,
    loss_spike,
    nonfinite,
    padding_mass,
    padding_rows,
    token_range,
    untrained_rows,
    vocab,
)
from guard.checks.spec import SeenKind, Spec, Watching
from guard.policy import Policy
from guard_server.wire import CheckName

__all__ = ["CHECKS", "SPECS", "watching"]

CHECKS: tuple[Spec[Any], ...] = (vocab.SPEC, token_range.SPEC, untrained_rows.SPEC,
                                 padding_mass.SPEC, nonfinite.SPEC, loss_spike.SPEC,
                                 padding_rows.SPEC, coverage.SPEC)
# Every spec with slots in the flags: the checks and the figures they share.
SPECS: tuple[Spec[Any], ...] = (loss.SPEC, grads.SPEC, *CHECKS)


@functools.cache  # a Policy is frozen: asked at every read, answered once
def watching(policy: Policy) -> Watching:
    """Per kind of data, the enabled checks that need it; {} where coverage is off."""
    if not policy.enabled("coverage"):
        return {}
    out: dict[SeenKind, tuple[CheckName, ...]] = {}
    for spec in CHECKS:
        if policy.enabled(spec.check):
            for kind in spec.needs:
                out[kind] = (*out.get(kind, ()), spec.check)
    return out
