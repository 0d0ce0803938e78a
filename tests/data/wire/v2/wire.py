"""The report wire format (docs/wire.md): its one definition, pydantic only.

The library builds its reports with these models and clips to these limits; the server
validates every request body against them. Importing this module pulls in no fastapi.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

__all__ = [  # noqa: RUF022 - sorted() order, as tests/server/test_isolation.py checks
    "ACTIONS",
    "ATTACH_ID_PATTERN",
    "ActionName",
    "AttachId",
    "CHECKS",
    "CheckName",
    "Event",
    "MAX_BATCH_REPORTS",
    "MAX_COUNT",
    "MAX_EVENTS",
    "MAX_MESSAGE",
    "MAX_MODULE",
    "NonFinite",
    "OutOfRange",
    "RUN_ID_PATTERN",
    "ReportBatch",
    "RunId",
    "StepReport",
    "UntrainedRows",
    "UntrainedTokens",
    "VocabSizes",
    "bearer_token",
]

CheckName = Literal[
    "alignment", "vocab", "padding_mass", "nonfinite", "token_range", "loss_spike",
    "padding_rows", "coverage", "untrained_rows",
]
# "off" never appears on the wire: an off check records nothing.
ActionName = Literal["fail", "mask", "skip", "warn", "repair"]
CHECKS: tuple[str, ...] = get_args(CheckName)
ACTIONS: tuple[str, ...] = get_args(ActionName)

# Bounds of one report: a request stays far below the body limit (1 MiB) even with every
# event at its longest, and a dashboard's event list stays readable.
MAX_EVENTS = 32
MAX_MESSAGE = 4096
MAX_MODULE = 256  # a module's qualified name; deep HF models stay under 120 characters
MAX_BATCH_REPORTS = 1000
# Counts stop at 2**53, the largest integer a float64 (a Prometheus sample, a JSON number in
# most parsers) holds exactly: a hostile 10**400 is a 422 here, not a crash at scrape time.
MAX_COUNT = 2**53
RUN_ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"
# One attach of a guard (uuid4 hex from the library): a restart under the same run_id and rank
# is a new attach, which the server tells apart from a late report of the old one by this id.
ATTACH_ID_PATTERN = r"^[A-Za-z0-9_-]{8,64}$"


def bearer_token(value: str, source: str) -> str:
    """The token both ends send and compare (`Authorization: Bearer <token>`): `value` without
    surrounding whitespace (a Kubernetes Secret made with --from-file ends in a newline).
    ValueError, naming `source` and never quoting the token, when nothing is left or a
    character could not go in a header as it is (RFC 6750: letters, digits, punctuation)."""
    token = value.strip()
    if not token:
        raise ValueError(f"{source} is empty; unset it to send and accept reports without one")
    at = next((i for i, ch in enumerate(token) if not "!" <= ch <= "~"), None)
    if at is not None:
        ch = token[at]
        kind = ("a space" if ch.isspace() else "a non-ASCII character" if not ch.isascii()
                else "a control character")
        raise ValueError(f"character {at + 1} of {source} is {kind}; a bearer token is letters, "
                         "digits and ASCII punctuation only (it goes in an HTTP header as it is)")
    return token


def _integral(value: object) -> object:
    # JSON Schema (and so the OpenAPI document) counts 3.0 as an integer; strict mode would
    # not. Accept integral floats, while "3" and true stay type errors.
    return int(value) if isinstance(value, float) and value.is_integer() else value


Count = Annotated[int, Field(ge=0, le=MAX_COUNT), BeforeValidator(_integral)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
Ratio = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
RunId = Annotated[str, Field(min_length=1, max_length=128, pattern=RUN_ID_PATTERN)]
AttachId = Annotated[str, Field(min_length=8, max_length=64, pattern=ATTACH_ID_PATTERN)]
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


class UntrainedRows(_Wire):
    """Rows of the real vocab found untrained at attach and not repaired since, per weight."""

    embedding: Count
    lm_head: Count


class UntrainedTokens(_Wire):
    """Cumulative count of input ids and labels that fell on untrained rows."""

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
    message: Annotated[str, Field(max_length=MAX_MESSAGE)]
    module: Annotated[str, Field(max_length=MAX_MODULE)] | None


class StepReport(_Wire):
    """The guard's state at one step boundary; counters are cumulative since attach."""

    # Every field is required, nullable ones included: a client that forgets one is a 422 that
    # names it, not a silent zero on a dashboard.
    attach_id: AttachId
    step: Count
    timestamp: Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
    loss: Finite | None
    padding_mass: Ratio | None
    padding_mass_max: Ratio | None
    nonfinite: NonFinite
    out_of_range: OutOfRange
    untrained_rows: UntrainedRows | None  # null: the check is off
    untrained_tokens: UntrainedTokens
    violations: dict[CheckName, dict[ActionName, Count]]
    skipped_steps: Count
    halted: CheckName | None
    vocab: VocabSizes
    dropped_reports: Count
    final: bool
    events: Annotated[list[Event], Field(max_length=MAX_EVENTS)]


class ReportBatch(_Wire):
    """A batch of step reports from one rank of one run (the body of POST /v1/reports)."""

    run_id: RunId
    rank: Rank
    reports: Annotated[list[StepReport], Field(min_length=1, max_length=MAX_BATCH_REPORTS)]
