"""Pydantic models of the report wire format (docs/wire.md), validated at the edge."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

__all__ = [
    "ActionName",
    "CheckName",
    "Event",
    "NonFinite",
    "OutOfRange",
    "ReportBatch",
    "StepReport",
    "VocabSizes",
]

CheckName = Literal["alignment", "vocab", "padding_mass", "nonfinite", "token_range", "loss_spike"]
# "off" never appears on the wire: an off check records nothing.
ActionName = Literal["fail", "mask", "skip", "warn"]


def _integral(value: object) -> object:
    # JSON Schema (and so the OpenAPI document) counts 3.0 as an integer; strict mode would
    # not. Accept integral floats, while "3" and true stay type errors.
    return int(value) if isinstance(value, float) and value.is_integer() else value


# Counts stop at 2**53, the largest integer a float64 (a Prometheus sample, a JSON number in
# most parsers) holds exactly: a hostile 10**400 is a 422 here, not a crash at scrape time.
Count = Annotated[int, Field(ge=0, le=2**53), BeforeValidator(_integral)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
Ratio = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
RunId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")]
Rank = Annotated[int, Field(ge=0, le=65535), BeforeValidator(_integral)]


class _Wire(BaseModel):
    # strict: "1" is not an int and true is not a count; frozen: the store shares instances.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class NonFinite(_Wire):
    """Cumulative count of non-finite values seen per tensor."""

    logits: Count
    hidden: Count
    loss: Count


class OutOfRange(_Wire):
    """Cumulative count of ghost or out-of-range token ids."""

    input: Count
    label: Count


class VocabSizes(_Wire):
    """The three vocabulary sizes: tokenizer's, the embedding rows, the aligned size."""

    real: Count
    rows: Count
    aligned: Count


class Event(_Wire):
    """One violation raised at a step boundary, with the guard's message."""

    check: CheckName
    action: ActionName
    step: Count
    message: Annotated[str, Field(max_length=4096)]
    module: Annotated[str, Field(max_length=256)] | None


class StepReport(_Wire):
    """The guard's state at one step boundary; counters are cumulative since attach."""

    # Every field is required, nullable ones included: a client that forgets one is a 422 that
    # names it, not a silent zero on a dashboard.
    step: Count
    timestamp: Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
    loss: Finite | None
    padding_mass: Ratio | None
    padding_mass_max: Ratio | None
    nonfinite: NonFinite
    out_of_range: OutOfRange
    violations: dict[CheckName, dict[ActionName, Count]]
    skipped_steps: Count
    halted: CheckName | None
    vocab: VocabSizes
    dropped_reports: Count
    final: bool
    events: Annotated[list[Event], Field(max_length=32)]


class ReportBatch(_Wire):
    """A batch of step reports from one rank of one run (the body of POST /v1/reports)."""

    run_id: RunId
    rank: Rank
    reports: Annotated[list[StepReport], Field(min_length=1, max_length=1000)]
