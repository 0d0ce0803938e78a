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
from guard_server.families import MAX_SERIES_PER_RANK, TYPICAL_SERIES_PER_RANK
from guard_server.wire import MAX_EVENTS, bearer_token

__all__ = ["ENV_PREFIX", "JSON_PAGE_BYTES", "Settings"]

ENV_PREFIX = "GUARD_SERVER_"
# What uvicorn holds of one body beyond what the route has taken: up to its 64 KiB high-water
# mark, where it stops reading, plus one read (64 KiB, guard_server.connections).
_CHUNK_BYTES = (64 + 64) << 10
# The event loop parses one body at a time: the body, and its parsed batch at up to ~11x its
# JSON (1 MiB of short events is 10,000 Event models, 11 MiB; tests/server/test_settings.py).
_PARSED_PER_BODY = 12
# Bodies that may wait for a turn, per slot of GUARD_SERVER_MAX_INFLIGHT_BODIES (limits.py). A
# waiting body costs one read of its connection (reading pauses until its turn), and the count
# lags the turns: a waiter counts until its task runs, after the slot it got was freed, so as
# many waiters as slots turned honest bursts away (16 ranks pushing back to back: a 429 in 200).
WAITING_PER_SLOT = 8
# What one scrape in flight holds (guard_server/exposition.py; tests/server/test_exposition.py
# measures it): the sorted (run_id, rank) key of every rank (~70 bytes each), a piece of
# samples while it is built and encoded (up to 3.6 MiB with the costliest series), and what its
# connection has not taken of the chunk before (128 KiB and a piece's text, in two copies).
_SCRAPE_BYTES_PER_RANK = 128
_SCRAPE_PIECE_BYTES = 5 << 20
# A page of GET /v1/runs/{run_id}'s JSON stops before this (routes/runs.py); built a rank at a
# time, a read holds about twice it at its peak (tests/server/test_hostile.py). 2 MiB (it was
# 4): with a read's answer counted in the budget, the typical fleet the caps admit still fits.
JSON_PAGE_BYTES = 2 << 20
# A page of HTML is rendered whole: Jinja's pieces, the text, its bytes; ~3.2x the page at the
# peak of a render (bench/page.py), counted 4x.
_RENDER_PER_PAGE = 4
# The push sink reads the same variable, so one GUARD_TOKEN configures both ends.
_TOKEN_VARS = ("GUARD_SERVER_TOKEN", "GUARD_TOKEN")


MAX_RANKS = 16384  # GUARD_SERVER_MAX_RANKS' default, over all runs
# Series each typical rank may add beyond its own before the series cap refuses it (a
# violation counter of a new action, a halt).
SPARE_SERIES = 4

class Settings(BaseSettings):
    """Validated server settings; every error names the variable it came from."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_by_name=True)

    host: str = "127.0.0.1"
    port: int = Field(default=9400, ge=0, le=65535)  # 0 binds any free port (tests)
    max_body_bytes: int = Field(default=1 << 20, ge=1024)  # 1 MiB holds ~1000 step reports
    # Caps: a scrape of the typical ranks they admit must stay well inside Prometheus' default
    # 10 s scrape_timeout on 2 cores (bench/ingest.py measures it: docs/benchmarks.md).
    max_runs: int = Field(default=64, ge=1)
    max_ranks_per_run: int = Field(default=4096, ge=1)
    max_ranks: int = Field(default=MAX_RANKS, ge=1)
    # Series on /metrics: a scrape's cost grows with them, not with ranks. A rank has from
    # TYPICAL_SERIES_PER_RANK (a healthy rank under the default policy) to MAX_SERIES_PER_RANK
    # (every check with every action and a halt; guard_server/families.py counts both from
    # its table), so the default admits max_ranks typical ranks with SPARE_SERIES each to
    # spare, and max_series // MAX_SERIES_PER_RANK of the costliest (docs/server.md gives the
    # numbers, held to these by tests/server/test_settings.py).
    max_series: int = Field(default=MAX_RANKS * (TYPICAL_SERIES_PER_RANK + SPARE_SERIES),
                            ge=MAX_SERIES_PER_RANK)
    # The memory the server may grow by: the state (reports and events, estimated in bytes;
    # a typical rank holds ~6.6 KiB, one at every wire limit ~0.55 MiB) plus a reserve for the
    # requests in flight (`inflight_bytes`).
    max_bytes: int = Field(default=256 << 20, ge=1 << 20)
    # Bodies read at once; 8x as many more wait for a turn (a second at most), the rest get 429
    # at once. A push of a few KiB arrives with its head and holds a turn for microseconds; the
    # limit is what bounds a flood of slow 1 MiB bodies (each held until it is whole).
    max_inflight_bodies: int = Field(default=8, ge=1)
    # Scrapes of /metrics written at once; 8x as many more wait for a turn (scrape_wait_s at
    # most, then 503), the rest get 503 at once. A scrape holds a few MiB whatever the state
    # (it is written a piece at a time), and 4 turns leave a Prometheus HA pair room to spare
    # (and a client that reads slowly holds one of four). They share one CPU (the GIL).
    max_inflight_scrapes: int = Field(default=4, ge=1)
    # Reads answered at once (the pages, GET /v1/runs/{run_id}), each holding its answer until
    # the client has taken it; 8x as many more wait for a turn (5 s at most), the rest get 429.
    # Twelve clients that asked for the list of runs and never read grew the server by 259 MiB
    # when nothing counted them. People with a browser and a few scripts: two turns are plenty.
    max_inflight_reads: int = Field(default=2, ge=1)
    # The bytes of a page of HTML: its rows are cut to fit, whatever text the trainers sent
    # (the rest on the next page, or in JSON); a run's section on the list of runs is at most
    # ~0.25 MiB, so the smallest bound still shows one.
    max_page_bytes: int = Field(default=1 << 20, ge=512 << 10)
    # Prometheus' default scrape_timeout: a scrape that waited longer has been given up on.
    scrape_wait_s: float = Field(default=10.0, gt=0, allow_inf_nan=False)
    rank_ttl_s: float = Field(default=900.0, gt=0, allow_inf_nan=False)  # 15 min of silence
    finished_ttl_s: float = Field(default=300.0, ge=0, allow_inf_nan=False)  # a few scrapes
    events_per_rank: int = Field(default=MAX_EVENTS, ge=0, le=MAX_EVENTS)  # one report's worth
    # Fields of a newer guard this server does not know: stored without, counted. Past these a
    # batch is a 422, found before it is parsed (guard_server/shape.py): 96,000 of them in one
    # 1 MiB body took 0.65-2.9 s and ~105 MiB to read. A wire version adds a handful of fields
    # (version 3: seven); their values are numbers and names of a few hundred bytes.
    max_unknown_fields: int = Field(default=64, ge=0)  # in one report (or the batch's top level)
    max_unknown_bytes: int = Field(default=256 << 10, ge=0)  # names and values, in one batch
    # How fast a rank's step may move ahead: a token bucket of STEP_BURST steps, refilled at
    # MAX_STEP_RATE a second (no language model trains 1000 optimizer steps a second), so over
    # any t seconds the step moves at most STEP_BURST + MAX_STEP_RATE * t however many reports
    # carry it, and a forged step 2**53 is a 409, not a rank frozen until its step catches up.
    max_step_rate: float | None = Field(default=1000.0, gt=0, allow_inf_nan=False)
    step_burst: int = Field(default=10_000, ge=0)
    # Connections: beyond the limit new ones are closed at once; a request must arrive
    # (headers and body) within the read timeout; idle keep-alive connections close after
    # keep_alive_s. Pushes come once a second per rank, so 5 s keeps them reusing one.
    max_connections: int = Field(default=2048, ge=8)
    read_timeout_s: float = Field(default=10.0, gt=0, allow_inf_nan=False)
    # An answer must be taken whole within this of its request's head, or the connection is
    # reset: a client that stops reading (or reads a scrape a byte at a time) would hold its
    # scrape's turn, and what the connection has not taken, for as long as it likes. The
    # costliest scrape the caps admit (86 MB) is written in ~5 s on 2 cores.
    write_timeout_s: float = Field(default=60.0, gt=0, allow_inf_nan=False)
    # A client that takes none of its answer for this long while the server waits to write
    # (more than 64 KiB unsent) is reset: four clients that asked for /metrics and never read
    # held every scrape turn for the 60 s above. Prometheus takes a scrape as it comes; a
    # reader that takes 48 KiB every 5 s goes on, up to the write timeout.
    write_stall_s: float = Field(default=5.0, gt=0, allow_inf_nan=False)
    keep_alive_s: float = Field(default=5.0, gt=0, allow_inf_nan=False)
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    access_log: bool = False  # one line per push would dwarf everything else in the log
    token: SecretStr | None = Field(default=None, validation_alias=AliasChoices(*_TOKEN_VARS))
    token_file: Path | None = None
    # With a token, the JSON reads and the API docs need it too; /metrics only when this is
    # set (Prometheus sends it with `authorization: {credentials: ...}` in its scrape config).
    metrics_token: bool = False
    # TLS for binds beyond loopback, handed to uvicorn as they are.
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None

    def __init__(self, **values: Any) -> None:
        _reject_unknown_env()
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise SettingsError(_problems(exc)) from None

    @field_validator("token")
    @classmethod
    def _token_as_sent(cls, token: SecretStr | None) -> SecretStr | None:
        # The push sink applies the same rule to GUARD_TOKEN (guard_server.wire.bearer_token).
        if token is None:
            return None
        return SecretStr(bearer_token(token.get_secret_value(), "the token"))

    @model_validator(mode="after")
    def _read_token_file(self) -> Settings:
        if self.token_file is None:
            return self
        if self.token is not None:
            raise ValueError("token_file: set a token or a token file, not both")
        where = f"token file {str(self.token_file)!r}"
        try:
            text = self.token_file.read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"token_file: cannot read {where}: {exc}") from exc
        except UnicodeDecodeError:  # its message would quote a byte of the token
            raise ValueError(f"token_file: {where} is not UTF-8 text") from None
        try:
            secret = bearer_token(text, "the token in " + where)
        except ValueError as exc:
            raise ValueError(f"token_file: {exc}") from None
        self.token = SecretStr(secret)
        return self

    @property
    def inflight_bytes(self) -> int:
        """The most requests in flight hold: each body being read (up to MAX_BODY_BYTES and
        the chunk that passes it), what uvicorn buffers of each body waiting for its turn, the
        one body being parsed with its parsed batch, and each scrape being written."""
        reading = self.max_inflight_bodies * (self.max_body_bytes + _CHUNK_BYTES)
        waiting = self.max_inflight_bodies * WAITING_PER_SLOT * _CHUNK_BYTES
        return (reading + waiting + _PARSED_PER_BODY * self.max_body_bytes
                + self.max_inflight_scrapes * self.scrape_bytes
                + self.max_inflight_reads * self.read_bytes)

    @property
    def read_bytes(self) -> int:
        """The most one read in flight holds: a JSON page being built, or a page of HTML
        being rendered, until its client has taken it."""
        return max(2 * JSON_PAGE_BYTES, _RENDER_PER_PAGE * self.max_page_bytes)

    @property
    def scrape_bytes(self) -> int:
        """The most one scrape in flight holds, with every rank the caps admit."""
        return self.max_ranks * _SCRAPE_BYTES_PER_RANK + _SCRAPE_PIECE_BYTES

    @property
    def state_bytes(self) -> int:
        """The part of MAX_BYTES the stored state may use: the rest is kept for requests in
        flight (`inflight_bytes`)."""
        return self.max_bytes - self.inflight_bytes

    @model_validator(mode="after")
    def _room_for_state(self) -> Settings:
        if self.state_bytes < self.max_body_bytes:
            need = self.inflight_bytes + self.max_body_bytes
            raise ValueError(
                f"max_bytes: at least {need} bytes with GUARD_SERVER_MAX_BODY_BYTES="
                f"{self.max_body_bytes}, GUARD_SERVER_MAX_INFLIGHT_BODIES="
                f"{self.max_inflight_bodies}, GUARD_SERVER_MAX_INFLIGHT_SCRAPES="
                f"{self.max_inflight_scrapes}, GUARD_SERVER_MAX_INFLIGHT_READS="
                f"{self.max_inflight_reads} and GUARD_SERVER_MAX_RANKS={self.max_ranks} "
                "(the requests in flight, and one rank's state)"
            )
        return self

    @model_validator(mode="after")
    def _tls_pair(self) -> Settings:
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            missing = "ssl_keyfile" if self.ssl_keyfile is None else "ssl_certfile"
            raise ValueError(f"{missing}: TLS needs both a certificate and a key file")
        for name in ("ssl_certfile", "ssl_keyfile"):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                raise ValueError(f"{name}: file {str(path)!r} does not exist")
        return self


def _env_name(field: str) -> str:
    if field == "token":
        return " or ".join(_TOKEN_VARS)
    return ENV_PREFIX + field.upper()


def _problems(exc: ValidationError) -> dict[str, str]:
    problems: dict[str, str] = {}
    for err in exc.errors(include_url=False):
        why = err["msg"].removeprefix("Value error, ")
        # Model-level checks have no loc; their messages start with the field they are about.
        field, _, rest = why.partition(": ") if not err["loc"] else (str(err["loc"][0]), "", "")
        why = rest or why
        # Errors on an aliased field carry the alias (GUARD_TOKEN ...) as their loc.
        field = "token" if field in _TOKEN_VARS else field
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
