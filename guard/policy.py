"""The policy: per check what to do, validated at the edge (unknown keys are errors)."""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from enum import StrEnum
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from guard.quote import quote
from guard.vocab import untrained_rules
from guard_server.wire import CHECKS, RunId

__all__ = ["ATTACH_CHECKS", "CHECKS", "STEP_CHECKS", "Action", "Policy", "default_run_id"]

# The check names are the wire's (guard_server/wire.py); these run once, at attach, the
# others every step.
ATTACH_CHECKS = ("alignment", "vocab")
STEP_CHECKS = tuple(c for c in CHECKS if c not in ATTACH_CHECKS)


class Action(StrEnum):
    """What a check does when it fires (DESIGN.md); equal to its policy-file string."""

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


class _Strict(BaseModel):
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


class AttachCheck(_Strict):
    action: Literal["fail", "warn", "off"] = "fail"


class PaddingMassCheck(_Strict):
    """What a violation is: guard/checks/padding_mass.py; the measurements behind the default:
    docs/checks.md."""

    action: Literal["mask", "fail", "warn", "off"] = "mask"
    # How many times an average real id's probability a padding column may take, at the worst
    # sampled position, in the logits the loss uses. Healthy padding rows (a normal init, HF's
    # mean resize, a trained model) measured 0.2-1.1x; the seed's garbage rows 1e5x and more.
    excess: float = Field(10.0, gt=1.0)
    # An absolute bound on that mass instead of `excess`, e.g. the seed's per-step assertion
    # 1e-6: every padded model's padding columns take more than that before training, so it
    # suits heads whose padding rows must already be masked or empty.
    threshold: float | None = Field(None, ge=0.0, le=1.0)
    # At most this many strided positions a forward, and at most one in 16 of them: a bounded
    # share of the loss's own work on the logits (docs/checks.md); exact measures them all.
    sample_tokens: int = Field(256, ge=1)
    exact: bool = False


class NonfiniteCheck(_Strict):
    action: Literal["fail", "skip", "warn", "off"] = "fail"
    # Name the first module whose output went non-finite (guard/step/localise.py): one no-grad
    # re-run of the failing forward, or per-module flags armed for the next step. Costs
    # nothing until nonfinite fires; off for models whose forward must not run twice.
    localise: bool = True


class TokenRangeCheck(_Strict):
    action: Literal["fail", "warn", "off"] = "fail"
    # PyTorch's CrossEntropyLoss default; labels equal to it are sequence padding, not ghosts.
    ignore_index: int | None = -100


class LossSpikeCheck(_Strict):
    """Rule in guard/device/loss.py; defaults compared with Megatron / llm-foundry / Lightning in
    docs/loss_spike.md."""

    action: Literal["fail", "skip", "warn", "off"] = "warn"
    # Megatron-LM's spiky-loss factor: far above any noise, well below the seed's 2.1 -> 87.3.
    factor: float = Field(10.0, gt=1.0)
    # llm-foundry's KillLossSpike window: the reference is the median of this many losses.
    window: int = Field(100, ge=2)
    # Finite losses needed before the check can fire: a median of fewer is one odd batch.
    warmup: int = Field(10, ge=1)
    # A rise smaller than this (loss units, nats per token) is noise even at a large ratio:
    # fine-tuning at loss 0.05 sees batches at 0.6.
    min_delta: float = Field(1.0, ge=0.0)

    @model_validator(mode="after")
    def _warmup_fits(self) -> LossSpikeCheck:
        if self.warmup > self.window:
            raise ValueError(f"warmup ({self.warmup}) must be <= window ({self.window}): the "
                             "history never holds more than window losses")
        return self


class PaddingRowsCheck(_Strict):
    """The padding rows [real, rows) of the embedding and lm_head weights, at attach and at
    each read: non-finite values, or a norm `factor` times the largest real row's."""

    # repair: each padding row becomes the mean of the real rows, so once the guard is gone a
    # padding id gets at most the real ids' mean probability (guard/device/rows.py says why
    # not zeros), and HF models stop generating them (generation_config.suppress_tokens).
    action: Literal["repair", "fail", "warn", "off"] = "repair"
    # A trained or initialised row has a norm within a few times its neighbours' (init std
    # 0.02 x sqrt(d); training moves rows slowly); a row 10x the largest real one is no token
    # the model learnt: what torch.empty or a wrong resize leaves (1e30, 1e-30, NaN).
    factor: float = Field(10.0, gt=1.0, allow_inf_nan=False)


class CoverageCheck(_Strict):
    """Every enabled per-step check saw its data in each training step: logits through the
    head, labels, a loss (guard/step/verdict.py says what each needs)."""

    # warn: a blind check is a setup to fix, not a broken step; it is logged at its first
    # blind step and counted every step (alert GuardBlind).
    action: Literal["fail", "warn", "off"] = "warn"


class UntrainedRowsCheck(_Strict):
    """Rows of the real vocab [0, real) that were never trained, in the embedding and an untied
    head: found at attach, the ids that fall on them counted every step (guard/device/
    untrained.py; the thresholds measured in docs/checks.md)."""

    # repair: the used rows become the mean of the trained rows, in place, before the update
    # of the first step that uses them (what Unsloth's fix_untrained_tokens does before
    # training). A base checkpoint fine-tuned with its instruct chat template uses them at step
    # 1, and stopping there (fail) asks for this very fix; warn leaves zero rows in training.
    action: Literal["repair", "fail", "warn", "off"] = "repair"
    # The rules' thresholds, each explained where it is defined (guard/vocab/untrained_rules.py):
    # every |value| of a row <= epsilon; a norm under norm_ratio x the median row's; at least
    # `duplicates` bitwise-identical rows.
    epsilon: float = Field(untrained_rules.EPSILON, ge=0.0)
    norm_ratio: float = Field(untrained_rules.NORM_RATIO, gt=0.0, lt=1.0)
    duplicates: int = Field(untrained_rules.DUPLICATES, ge=2)


class Checks(_Strict):
    alignment: AttachCheck = AttachCheck()
    vocab: AttachCheck = AttachCheck()
    padding_mass: PaddingMassCheck = PaddingMassCheck()
    nonfinite: NonfiniteCheck = NonfiniteCheck()
    token_range: TokenRangeCheck = TokenRangeCheck()
    loss_spike: LossSpikeCheck = LossSpikeCheck()
    padding_rows: PaddingRowsCheck = PaddingRowsCheck()
    coverage: CoverageCheck = CoverageCheck()
    untrained_rows: UntrainedRowsCheck = UntrainedRowsCheck()


class VocabSection(_Strict):
    real_size: int | None = Field(None, ge=1)
    # Without a real size (given, or found in the model's config or checkpoint) the guard takes
    # every row as real and watches no padding column: a coverage warning at attach, or with
    # this set an AttachError.
    require_real_size: bool = False
    # Tensor cores and fused kernels want the vocab dim a multiple of 64 (seed digest).
    pad_multiple: int = Field(64, ge=1)
    tensor_parallel: int = Field(1, ge=1)


class Cadence(_Strict):
    read_every: int = Field(1, ge=1)


# Matched whole (fullmatch): re.match's `$` would take a trailing newline.
_HOST_PORT = re.compile(r"(?P<host>[A-Za-z0-9_.\-]+|\[[0-9A-Fa-f:]+\]):(?P<port>\d{1,5})")
_URL = re.compile(r"https?://[^\s/]+(/\S*)?")


class Export(_Strict):
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
        if v is not None and not _URL.fullmatch(v):
            raise ValueError("expected an http(s) URL such as http://guard-server:9400, got "
                             f"{quote(v)}")
        return v

    def serve_address(self, local_rank: int = 0) -> tuple[str, int] | None:
        """(host, port + local_rank), so each rank of a node gets its own endpoint."""
        if self.serve is None:
            return None
        host, _, port = self.serve.rpartition(":")
        return host.strip("[]"), int(port) + local_rank if int(port) else 0


class Policy(_Strict):
    """What each check does; see DESIGN.md, 'Policy file'."""

    run_id: RunId | None = None
    vocab: VocabSection = VocabSection()
    checks: Checks = Checks()
    cadence: Cadence = Cadence()
    export: Export = Export()

    def action(self, check: str) -> Action:
        return Action(getattr(self.checks, check).action)

    def enabled(self, check: str) -> bool:
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

    def acting(self, action: Action, checks: tuple[str, ...] = STEP_CHECKS) -> list[str]:
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
            log.warning("guard: TORCHELASTIC_RUN_ID %s is no run_id (1-128 characters of A-Z, "
                        "a-z, 0-9, _ . : -); reporting as %r, which differs per rank: set run_id "
                        "in the policy", quote(rid), fallback)
    return fallback
