"""The report wire format (docs/wire.md): its one definition, pydantic only.

The library builds its reports with these models and clips to these limits; the server
validates every request body against them. Importing this module pulls in no fastapi.

The wire evolves compatibly (docs/wire.md, "Versions"): a field added after the first release
is optional, `Annotated[... | None, Since(N)] = None` (absent: not reported), and a check name
added after it is listed in CHECK_SINCE; WIRE_VERSION is the newest of them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Literal, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic.fields import FieldInfo

__all__ = [  # noqa: RUF022 - sorted() order, as tests/server/test_isolation.py checks
    "ACTIONS",
    "ATTACH_ID_PATTERN",
    "ActionName",
    "AttachId",
    "CHECKS",
    "CHECK_SINCE",
    "CheckName",
    "Event",
    "ID_KINDS",
    "IdKind",
    "MAX_BATCH_REPORTS",
    "MAX_COUNT",
    "MAX_EVENTS",
    "MAX_MESSAGE",
    "MAX_MODULE",
    "MAX_RANK",
    "NonFinite",
    "OutOfRange",
    "RUN_ID_PATTERN",
    "ReportBatch",
    "RunId",
    "Since",
    "StepReport",
    "TENSORS",
    "TensorKind",
    "UntrainedRows",
    "UntrainedTokens",
    "VocabSizes",
    "WEIGHTS",
    "WIRE_VERSION",
    "WIRE_VERSION_HEADER",
    "WeightName",
    "bearer_token",
    "since",
    "wire_models",
]

CheckName = Literal[
    "alignment", "vocab", "padding_mass", "nonfinite", "token_range", "loss_spike",
    "padding_rows", "coverage", "untrained_rows",
]
# "off" never appears on the wire: an off check records nothing.
ActionName = Literal["fail", "mask", "skip", "warn", "repair"]
CHECKS: tuple[CheckName, ...] = get_args(CheckName)
ACTIONS: tuple[ActionName, ...] = get_args(ActionName)
# The wire version each check name was added in; the first release's (1) are not listed.
CHECK_SINCE: Mapping[str, int] = {"untrained_rows": 2}
# Every answer of a guard server says the wire version it reads (a server of the first
# release, version 1, says none); the push sink sends a server no field or check it lacks.
WIRE_VERSION_HEADER = "Guard-Wire-Version"
# The values of the per-kind labels, declared once here: each is also the fields of its report
# model below, in this order (tests/test_contract.py holds them equal), and the library's
# specs key their slots by them (guard/checks/), the metric families emit them (families.py).
# NonFinite: guard_nonfinite_values_total; "grad" came with wire version 3 (optional).
TensorKind = Literal["logits", "hidden", "loss", "grad"]
IdKind = Literal["input", "label"]  # OutOfRange, UntrainedTokens: their `kind` label
WeightName = Literal["embedding", "lm_head"]  # UntrainedRows: guard_untrained_rows{weight}
TENSORS: tuple[TensorKind, ...] = get_args(TensorKind)
ID_KINDS: tuple[IdKind, ...] = get_args(IdKind)
WEIGHTS: tuple[WeightName, ...] = get_args(WeightName)


@dataclass(frozen=True)
class Since:
    """A field's metadata: the wire version that added it (after the first release, so the
    field is optional and its absence means "not reported", never a zero)."""

    version: int

# Bounds of one report: a request stays far below the body limit (1 MiB) even with every
# event at its longest, and a dashboard's event list stays readable.
MAX_EVENTS = 32
MAX_MESSAGE = 4096
MAX_MODULE = 256  # a module's qualified name; deep HF models stay under 120 characters
MAX_BATCH_REPORTS = 1000
MAX_RANK = 65535  # a global rank: far past the largest jobs' (a few tens of thousands of GPUs)
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
Name = Annotated[str, Field(max_length=MAX_MODULE)]  # a module's or parameter's qualified name
AttachId = Annotated[str, Field(min_length=8, max_length=64, pattern=ATTACH_ID_PATTERN)]
Rank = Annotated[int, Field(ge=0, le=MAX_RANK), BeforeValidator(_integral)]


class _Wire(BaseModel):
    # strict: "1" is not an int and true is not a count; frozen: the store shares instances.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class NonFinite(_Wire):
    """Cumulative count of non-finite values seen per tensor (for the logits, the positions;
    for the gradients, the parameters whose gradient holds a NaN/Inf)."""

    logits: Count
    hidden: Count
    loss: Count
    # None: the gradients are not checked (or a client before wire version 3).
    grad: Annotated[Count | None, Since(3)] = None


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

    # Every field of the first release is required, nullable ones included: a client that
    # forgets one is a 422 that names it, not a silent zero on a dashboard. A field added since
    # is optional, absent from the reports of an older guard (not reported: no series).
    attach_id: AttachId
    step: Count
    timestamp: Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
    loss: Finite | None
    padding_mass: Ratio | None
    padding_mass_max: Ratio | None
    nonfinite: NonFinite
    out_of_range: OutOfRange
    untrained_rows: Annotated[UntrainedRows | None, Since(2)] = None  # null: the check is off
    untrained_tokens: Annotated[UntrainedTokens | None, Since(2)] = None
    violations: dict[CheckName, dict[ActionName, Count]]
    skipped_steps: Count
    halted: CheckName | None
    vocab: VocabSizes
    dropped_reports: Count
    final: bool
    events: Annotated[list[Event], Field(max_length=MAX_EVENTS)]
    # Wire version 3: the gradients, log Z, the updates the loop skipped.
    grad_norm: Annotated[Finite | None, Since(3)] = None  # total norm of the last step read
    grad_norm_top: Annotated[Name | None, Since(3)] = None  # its largest parameter, by name
    grad_norm_top_share: Annotated[Ratio | None, Since(3)] = None  # of the squared norm
    logsumexp: Annotated[Finite | None, Since(3)] = None  # log Z of the real-vocab logits
    logsumexp_max: Annotated[Finite | None, Since(3)] = None  # and its largest
    scaler_skipped_steps: Annotated[Count | None, Since(3)] = None  # skipped by GradScaler
    # The padding mass per position above which the padding_mass check fires (its policy's
    # threshold, or the excess bound for this vocab): what padding_mass_max is judged against.
    # Absent: not reported (the check is off, or an older guard): not shown.
    padding_mass_bound: Annotated[Ratio | None, Since(3)] = None


class ReportBatch(_Wire):
    """A batch of step reports from one rank of one run (the body of POST /v1/reports)."""

    run_id: RunId
    rank: Rank
    reports: Annotated[list[StepReport], Field(min_length=1, max_length=MAX_BATCH_REPORTS)]


def _models_in(annotation: object) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, _Wire):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def wire_models(model: type[BaseModel] = ReportBatch,
                path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], type[BaseModel]]]:
    """Every model of the wire, with the field names that lead to it from the batch
    (("reports", "nonfinite"), NonFinite); a list on the way is a level of its items."""
    yield path, model
    for name, info in model.model_fields.items():
        for inner in _models_in(info.annotation):
            yield from wire_models(inner, (*path, name))


def since(info: FieldInfo) -> int:
    """The wire version a field was added in (1: the first release's)."""
    return max([1, *(m.version for m in info.metadata if isinstance(m, Since))])


# The version this side speaks: its newest field's or check name's.
WIRE_VERSION = max([*(since(f) for _, m in wire_models() for f in m.model_fields.values()),
                    *CHECK_SINCE.values()])
