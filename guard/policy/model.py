"""The policy: per check what to do, validated at the edge (unknown keys are errors)."""

from __future__ import annotations

import logging
import os
import re
import socket
import time
import urllib.parse
from typing import Literal

from pydantic import Field, TypeAdapter, ValidationError, field_validator

from guard import constants
from guard.policy.checks import Checks
from guard.policy.strict import Action, Section
from guard.quote import quote
from guard_server.wire import CHECKS, CheckName, RunId

__all__ = ["ATTACH_CHECKS", "CHECKS", "STEP_CHECKS", "Policy", "default_run_id", "push_url"]

# The check names are the wire's (guard_server/wire.py); these run once, at attach, the
# others every step.
ATTACH_CHECKS: tuple[CheckName, ...] = ("alignment", "vocab")
STEP_CHECKS: tuple[CheckName, ...] = tuple(c for c in CHECKS if c not in ATTACH_CHECKS)


class VocabSection(Section):
    real_size: int | None = Field(None, ge=1, le=constants.MAX_IDS)
    # Without a real size (given, or found in the model's config or checkpoint) the guard takes
    # every row as real and watches no padding column: a coverage warning at attach, or with
    # this set an AttachError.
    require_real_size: bool = False
    # Tensor cores and fused kernels want the vocab dim a multiple of 64 (seed digest).
    pad_multiple: int = Field(64, ge=1, le=4096)  # kernels ask for 8 to 128
    # The largest tensor-parallel groups are 8 to 64 GPUs. With pad_multiple, the aligned size
    # stays far below the wire's 2**53.
    tensor_parallel: int = Field(1, ge=1, le=1024)


class Cadence(Section):
    # At least a read every 10,000 steps: past it a check would act hours late.
    read_every: int = Field(1, ge=1, le=10_000)
    # When fail / skip read the flags (guard/step/skip.py): `lagged`, one read late, the bad
    # update dropped on the device (an optimizer that takes found_inf: fused=True);
    # `before_update`, a read before each optimizer step (a host sync a step); `auto`, lagged
    # where the optimizer allows it.
    fail_read: Literal["auto", "lagged", "before_update"] = "auto"


# Matched whole (fullmatch): re.match's `$` would take a trailing newline.
_HOST_PORT = re.compile(r"(?P<host>[A-Za-z0-9_.\-]+|\[[0-9A-Fa-f:]+\]):(?P<port>\d{1,5})")
_URL = re.compile(r"https?://[^\s/]+(/\S*)?")
_USER_INFO = re.compile(r"//[^/@]*@")


def push_url(url: str) -> str:
    """`url` when a push sink can send to it: http(s), a host, a port from 1 to 65535 if any,
    no control character or space; else ValueError saying what is wrong. Checked at attach:
    one the sink could not use ended its thread at the first push (httpx.InvalidURL)."""
    shown = quote(_USER_INFO.sub("//***@", url))  # a token in the URL reaches no message
    if not _URL.fullmatch(url):
        raise ValueError(f"expected an http(s) URL such as http://guard-server:9400, got {shown}")
    bad = next((i for i, ch in enumerate(url) if not ch.isprintable()), None)
    if bad is not None:
        raise ValueError(f"character {bad + 1} of {shown} is {quote(url[bad])}; a URL holds no "
                         "control character")
    parts = urllib.parse.urlsplit(url)
    if not parts.hostname:
        raise ValueError(f"{shown} names no host; e.g. http://guard-server:9400")
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:
        raise ValueError(f"the port of {shown} is not one from 1 to 65535")
    import httpx  # here: only a policy that pushes needs it, and its sink imports it anyway

    try:
        httpx.Request("POST", url)  # what the sink's requests are made of
    except (httpx.InvalidURL, ValueError) as e:  # ValueError: an IDNA host, xn--
        raise ValueError(f"{shown} is no URL a request can go to ({quote(str(e))})") from None
    return url


class Export(Section):
    serve: str | None = "127.0.0.1:9464"
    push: str | None = None

    @field_validator("serve")
    @classmethod
    def _host_port(cls, v: str | None) -> str | None:
        if v is None:
            return v
        m = _HOST_PORT.fullmatch(v)
        if not m or not 0 <= int(m["port"]) <= 65535:
            raise ValueError(f"expected host:port such as 127.0.0.1:9464, got {quote(v)}")
        return v

    @field_validator("push")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        return None if v is None else push_url(v)

    def serve_address(self, local_rank: int = 0) -> tuple[str, int] | None:
        """(host, port + local_rank), so each rank of a node gets its own endpoint."""
        if self.serve is None:
            return None
        host, _, port = self.serve.rpartition(":")
        return host.strip("[]"), int(port) + local_rank if int(port) else 0


class Policy(Section):
    """What each check does; see README.md, 'Policy', and docs/checks.md, 'Policy keys'."""

    run_id: RunId | None = None
    vocab: VocabSection = VocabSection()
    checks: Checks = Checks()
    cadence: Cadence = Cadence()
    export: Export = Export()

    def action(self, check: CheckName) -> Action:
        return Action(getattr(self.checks, check).action)

    def enabled(self, check: CheckName) -> bool:
        """The check is computed (its action is not `off`)."""
        return self.action(check) is not Action.OFF

    @property
    def masks(self) -> bool:
        """The padding columns of the head's output are set to -inf."""
        return self.action("padding_mass") is Action.MASK

    @property
    def host_may_lag(self) -> bool:
        """No per-step check stops or drops a step (warn, mask, off only): the host may read
        the flags one step late and never stall the device."""
        return all(self.action(c) in (Action.WARN, Action.MASK, Action.REPAIR, Action.OFF)
                   for c in STEP_CHECKS)

    def acting(self, action: Action,
               checks: tuple[CheckName, ...] = STEP_CHECKS) -> list[CheckName]:
        """The checks among `checks` whose action is `action`."""
        return [c for c in checks if self.action(c) is action]


log = logging.getLogger("guard")

# The wire's own check of a run_id: re.match's `$` takes a trailing newline, pydantic's does not.
_RUN_ID: TypeAdapter[str] = TypeAdapter(RunId)


def default_run_id() -> str:
    """TORCHELASTIC_RUN_ID under torchrun (without surrounding whitespace: a value read from a
    file ends in a newline), else host-pid-time."""
    rid = os.environ.get("TORCHELASTIC_RUN_ID", "").strip()
    host = re.sub(r"[^A-Za-z0-9_.\-]", "-", socket.gethostname())[:64] or "host"
    fallback = f"{host}-{os.getpid()}-{int(time.time())}"
    if rid:
        try:
            return _RUN_ID.validate_python(rid)
        except ValidationError:
            log.warning("TORCHELASTIC_RUN_ID %s is no run_id (1-128 characters of A-Z, "
                        "a-z, 0-9, _ . : -); reporting as %r, which differs per rank: set run_id "
                        "in the policy", quote(rid), fallback)
    return fallback
