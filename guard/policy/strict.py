"""What every section of the policy shares: its actions, and a model that refuses unknown keys
and values of the wrong kind (the error names the key and quotes the value)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator

from guard.quote import quote

__all__ = ["Action", "Section"]


class Action(StrEnum):
    """What a check does when it fires (README.md, "Policy"); equal to its policy-file string."""

    FAIL = "fail"
    MASK = "mask"
    SKIP = "skip"
    WARN = "warn"
    REPAIR = "repair"
    OFF = "off"


_NUMBERS = (int, float, int | None, float | None)


def _noun(value: object) -> str:
    """`value`'s kind with its article: "a string", "an integer"."""
    return {bool: "a boolean", str: "a string", int: "an integer", float: "a number"}.get(
        type(value), f"a {type(value).__name__}")


class Section(BaseModel):
    # allow_inf_nan=False: `.inf` as a factor would silently disable its check.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _off(cls, data: Any) -> Any:
        """YAML 1.1 reads `off` (and `no`) as false: an action of false is `off`."""
        if isinstance(data, dict) and data.get("action") is False and "action" in cls.model_fields:
            data = {**data, "action": "off"}
        return data

    @field_validator("*", mode="before")
    @classmethod
    def _exact_kind(cls, value: Any, info: ValidationInfo) -> Any:
        """Where a number goes, a boolean or a string is refused (pydantic would take true as 1
        and "12" as 12); where a boolean goes, anything but true or false ("yes", 1)."""
        kind = cls.model_fields[str(info.field_name)].annotation
        if kind in _NUMBERS and isinstance(value, bool | str):
            raise ValueError(f"{quote(value)} is {_noun(value)}; expected a number")
        if kind is bool and not isinstance(value, bool):
            raise ValueError(f"{quote(value)} is {_noun(value)}; expected true or false")
        return value


