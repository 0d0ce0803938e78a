"""The policy: per check what to do, validated at the edge (unknown keys are errors). Read from
a file by guard/policy_file.py."""

from guard.policy.checks import (
    AttachCheck,
    Checks,
    CoverageCheck,
    LossSpikeCheck,
    NonfiniteCheck,
    PaddingMassCheck,
    PaddingRowsCheck,
    TokenRangeCheck,
    UntrainedRowsCheck,
)
from guard.policy.model import (
    ATTACH_CHECKS,
    CHECKS,
    STEP_CHECKS,
    Cadence,
    Export,
    Policy,
    VocabSection,
    default_run_id,
)
from guard.policy.strict import Action, Section

__all__ = ["ATTACH_CHECKS", "CHECKS", "STEP_CHECKS", "Action", "AttachCheck", "Cadence",
           "Checks", "CoverageCheck", "Export", "LossSpikeCheck", "NonfiniteCheck",
           "PaddingMassCheck", "PaddingRowsCheck", "Policy", "Section", "TokenRangeCheck",
           "UntrainedRowsCheck", "VocabSection", "default_run_id"]
