"""Server settings from GUARD_SERVER_* environment variables (pydantic-settings)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    AliasChoices,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from guard_server.errors import SettingsError

__all__ = ["ENV_PREFIX", "Settings"]

ENV_PREFIX = "GUARD_SERVER_"
# The push sink reads the same variable, so one GUARD_TOKEN configures both ends.
_TOKEN_VARS = ("GUARD_SERVER_TOKEN", "GUARD_TOKEN")


class Settings(BaseSettings):
    """Validated server settings; every error names the variable it came from."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_by_name=True)

    host: str = "127.0.0.1"
    port: int = Field(default=9400, ge=0, le=65535)  # 0 binds any free port (tests)
    max_body_bytes: int = Field(default=1 << 20, ge=1024)  # 1 MiB holds ~1000 step reports
    max_runs: int = Field(default=64, ge=1)
    # 4096 ranks x ~16 series each is ~65k series per run, about what one scrape should carry.
    max_ranks_per_run: int = Field(default=4096, ge=1)
    rank_ttl_s: float = Field(default=900.0, gt=0, allow_inf_nan=False)  # 15 min of silence
    finished_ttl_s: float = Field(default=300.0, ge=0, allow_inf_nan=False)  # a few scrapes
    events_per_rank: int = Field(default=32, ge=0, le=1024)  # one full report's worth
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    access_log: bool = False  # one line per push would dwarf everything else in the log
    token: SecretStr | None = Field(default=None, validation_alias=AliasChoices(*_TOKEN_VARS))
    token_file: Path | None = None

    def __init__(self, **values: Any) -> None:
        _reject_unknown_env()
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise SettingsError(_problems(exc)) from None

    @field_validator("token")
    @classmethod
    def _token_not_blank(cls, token: SecretStr | None) -> SecretStr | None:
        if token is not None and not token.get_secret_value().strip():
            raise ValueError("the token is empty; unset it to accept reports without one")
        return token

    @model_validator(mode="after")
    def _read_token_file(self) -> Settings:
        if self.token_file is None:
            return self
        if self.token is not None:
            raise ValueError("set a token or a token file, not both")
        try:
            secret = self.token_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ValueError(f"cannot read token file {str(self.token_file)!r}: {exc}") from exc
        if not secret:
            raise ValueError(f"token file {str(self.token_file)!r} is empty")
        self.token = SecretStr(secret)
        return self


def _env_name(field: str) -> str:
    if field == "token":
        return " or ".join(_TOKEN_VARS)
    return ENV_PREFIX + field.upper()


def _problems(exc: ValidationError) -> dict[str, str]:
    problems: dict[str, str] = {}
    for err in exc.errors(include_url=False):
        # The token file check is the only model-level one, hence the only error without a loc.
        field = str(err["loc"][0]) if err["loc"] else "token_file"
        # Errors on an aliased field carry the alias (GUARD_TOKEN ...) as their loc.
        field = "token" if field in _TOKEN_VARS else field
        why = err["msg"].removeprefix("Value error, ")
        # Quote the bad value, except the token (a secret) and a model-level input (all values).
        if err["loc"] and field != "token":
            why += f" (got {err['input']!r})"
        problems[_env_name(field)] = why
    return problems


def _reject_unknown_env() -> None:
    # pydantic-settings ignores unknown prefixed variables; a typo such as GUARD_SERVER_PROT
    # would silently fall back to a default, so name it instead.
    known = {_env_name(f) for f in Settings.model_fields if f != "token"} | set(_TOKEN_VARS)
    # Upper-cased because pydantic-settings matches names case-insensitively.
    names = {key.upper() for key in os.environ}
    unknown = sorted(n for n in names if n.startswith(ENV_PREFIX) and n not in known)
    if unknown:
        fields = ", ".join(sorted(known))
        raise SettingsError({name: f"unknown setting; known: {fields}" for name in unknown})
