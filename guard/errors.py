"""The one error module of logitguard.

    GuardError
     ├── PolicyError(ValueError)      a policy file or dict is invalid
     ├── AttachError                  the guard cannot attach to this model
     ├── CheckpointError(ValueError)  `guard audit` cannot read a model directory
     ├── StateError(ValueError)       a saved guard state does not fit this guard
     └── GuardViolation(RuntimeError) a check with action `fail` fired
"""

from __future__ import annotations

__all__ = ["AttachError", "CheckpointError", "GuardError", "GuardViolation", "PolicyError",
           "StateError"]


class GuardError(Exception):
    """Base of every error logitguard raises."""


class PolicyError(GuardError, ValueError):
    """A policy is invalid; `.source` names the file (or `<dict>`), `.problems` the keys."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"invalid policy {source}:\n{lines}")


class AttachError(GuardError):
    """The guard cannot attach: discovery failed or the arguments disagree."""


class CheckpointError(GuardError, ValueError):
    """A model directory cannot be audited; `.path` names the file, `.expected` what it lacks."""

    def __init__(self, path: str, expected: str) -> None:
        self.path = path
        self.expected = expected
        super().__init__(f"{path}: {expected}")


class StateError(GuardError, ValueError):
    """`Guard.load_state_dict` was given a state this guard cannot go on from (another model,
    another policy, a newer guard's); `.field` names the field of the state."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"guard state: {field}: {problem}")


class GuardViolation(GuardError, RuntimeError):
    """A check whose action is `fail` fired; every rank raises it at the same step.

    `.module` names the first module whose output went non-finite, when localised.
    """

    def __init__(
        self,
        message: str,
        *,
        check: str,
        step: int,
        rank: int,
        value: float,
        threshold: float,
        action: str = "fail",
        module: str | None = None,
    ) -> None:
        self.check = check
        self.step = step
        self.rank = rank
        self.value = value
        self.threshold = threshold
        self.action = action
        self.module = module
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only data would be lost by the default pickling (multiprocessing, torchrun).
        return (_rebuild_violation, (str(self), self.__dict__.copy()))


def _rebuild_violation(message: str, data: dict[str, object]) -> GuardViolation:
    err = GuardViolation.__new__(GuardViolation)
    RuntimeError.__init__(err, message)
    err.__dict__.update(data)
    return err
