"""The policy's `checks` section: one model per check, with its action and thresholds; each
number says where it comes from."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from guard import constants
from guard.policy.strict import Section

__all__ = ["MAX_WINDOW", "AttachCheck", "Checks", "CoverageCheck", "LossSpikeCheck",
           "NonfiniteCheck", "PaddingMassCheck", "PaddingRowsCheck", "TokenRangeCheck",
           "UntrainedRowsCheck", "VocabCheck"]

# Every number has a range (docs/checks.md, "Policy keys and their ranges", held to these
# models by tests/guard/test_policy_ranges.py): the code can act on any value in it, and a value
# outside is a PolicyError naming the key, never an allocation of terabytes (a window of 10**12
# losses) or an integer that wraps on the device (duplicates 2**63). Thresholds that are ratios
# or factors stop at 1e6: finite in float32, and past anything that still measures something.
MAX_WINDOW = 10_000


class AttachCheck(Section):
    action: Literal["fail", "warn", "off"] = "fail"


class VocabCheck(AttachCheck):
    """The sizes at attach; the tie of the embedding and the head at each read; tied copies
    on two pipeline stages compared every `tie_every` reads (a checksum of every row of both
    copies: a pass over the weight on two stages, docs/integrations.md)."""

    # Every 10 reads: a checksum pass over both copies costs about a forward of the head
    # (docs/benchmarks.md), a tenth of it a step; a drift at attach is found there. At least
    # every 10,000 reads, as cadence.read_every: past it a drift acts hours late.
    tie_every: int = Field(10, ge=1, le=10_000)


class PaddingMassCheck(Section):
    """What a violation is: guard/checks/padding_mass.py; the measurements behind the default:
    docs/checks.md."""

    action: Literal["mask", "fail", "warn", "off"] = "mask"
    # How many times an average real id's probability a padding column may take, at the worst
    # sampled position, in the logits the loss uses. Healthy padding rows (a normal init, HF's
    # mean resize, a trained model) measured 0.2-1.1x; the seed's garbage rows 1e5x and more.
    excess: float = Field(10.0, gt=1.0, le=1e6)
    # An absolute bound on that mass instead of `excess`, e.g. the seed's per-step assertion
    # 1e-6: every padded model's padding columns take more than that before training, so it
    # suits heads whose padding rows must already be masked or empty.
    threshold: float | None = Field(None, ge=0.0, le=1.0)
    # At most this many strided positions a forward, and at most one in 32 of them: a bounded
    # share of the loss's own work on the logits (docs/checks.md); exact measures them all.
    sample_tokens: int = Field(256, ge=1, le=1 << 20)
    exact: bool = False


class NonfiniteCheck(Section):
    action: Literal["fail", "skip", "warn", "off"] = "fail"
    # Name the first module whose output went non-finite (guard/step/localise.py): one no-grad
    # re-run of the failing forward, or per-module flags armed for the next step. Costs
    # nothing until nonfinite fires; off for models whose forward must not run twice.
    localise: bool = True


class TokenRangeCheck(Section):
    action: Literal["fail", "warn", "off"] = "fail"
    # PyTorch's CrossEntropyLoss default; labels equal to it are sequence padding, not ghosts.
    ignore_index: int | None = Field(-100, ge=-(2**63), le=2**63 - 1)  # an int64 label


class LossSpikeCheck(Section):
    """Rule in guard/device/loss.py; defaults compared with Megatron / llm-foundry / Lightning in
    docs/loss_spike.md."""

    action: Literal["fail", "skip", "warn", "off"] = "warn"
    # Megatron-LM's spiky-loss factor: far above any noise, well below the seed's 2.1 -> 87.3.
    factor: float = Field(10.0, gt=1.0, le=1e6)
    # llm-foundry's KillLossSpike window: the reference is the median of this many losses, a
    # (window,) tensor on the device (10,000: 40 KiB, its median a few microseconds a step).
    window: int = Field(100, ge=2, le=MAX_WINDOW)
    # Finite losses needed before the check can fire: a median of fewer is one odd batch.
    warmup: int = Field(10, ge=1, le=MAX_WINDOW)
    # A rise smaller than this (loss units, nats per token) is noise even at a large ratio:
    # fine-tuning at loss 0.05 sees batches at 0.6.
    min_delta: float = Field(1.0, ge=0.0, le=1e6)

    @model_validator(mode="after")
    def _warmup_fits(self) -> LossSpikeCheck:
        if self.warmup > self.window:
            raise ValueError(f"warmup ({self.warmup}) must be <= window ({self.window}): the "
                             "history never holds more than window losses")
        return self


class PaddingRowsCheck(Section):
    """The padding rows [real, rows) of the embedding and lm_head weights, at attach and at
    each read: non-finite values, or a norm `factor` times the largest real row's."""

    # repair: each padding row becomes the mean of the real rows, so once the guard is gone a
    # padding id gets at most the real ids' mean probability (guard/device/rows.py says why
    # not zeros), and HF models stop generating them (generation_config.suppress_tokens).
    action: Literal["repair", "fail", "warn", "off"] = "repair"
    # A trained or initialised row has a norm within a few times its neighbours' (init std
    # 0.02 x sqrt(d); training moves rows slowly); a row 10x the largest real one is no token
    # the model learnt: what torch.empty or a wrong resize leaves (1e30, 1e-30, NaN).
    factor: float = Field(10.0, gt=1.0, le=1e6)


class CoverageCheck(Section):
    """Every enabled per-step check saw its data in each training step: logits through the
    head, input ids, labels, a loss (each check's spec says what it needs: `Spec.needs`)."""

    # warn: a blind check is a setup to fix, not a broken step; it is logged at its first
    # blind step and counted every step (alert GuardBlind).
    action: Literal["fail", "warn", "off"] = "warn"


class UntrainedRowsCheck(Section):
    """Rows of the real vocab [0, real) that were never trained, in the embedding and an untied
    head: found at attach, the ids that fall on them counted every step (guard/device/
    untrained.py; the thresholds measured in docs/checks.md)."""

    # repair: the used rows become the mean of the trained rows, in place, before the update
    # of the first step that uses them (what Unsloth's fix_untrained_tokens does before
    # training). A base checkpoint fine-tuned with its instruct chat template uses them at step
    # 1, and stopping there (fail) asks for this very fix; warn leaves zero rows in training.
    action: Literal["repair", "fail", "warn", "off"] = "repair"
    # The rules' thresholds (guard/checkpoint/untrained_rules.py), each default explained where
    # it is defined (guard/constants.py, which `guard audit` reads too): every |value| of a row
    # <= epsilon; a norm under norm_ratio x the median row's; at least `duplicates`
    # bitwise-identical rows.
    epsilon: float = Field(constants.EPSILON, ge=0.0, le=constants.MAX_EPSILON)
    norm_ratio: float = Field(constants.NORM_RATIO, gt=0.0, lt=1.0)
    duplicates: int = Field(constants.DUPLICATES, ge=2, le=constants.MAX_IDS)


class Checks(Section):
    alignment: AttachCheck = AttachCheck()
    vocab: VocabCheck = VocabCheck()
    padding_mass: PaddingMassCheck = PaddingMassCheck()
    nonfinite: NonfiniteCheck = NonfiniteCheck()
    token_range: TokenRangeCheck = TokenRangeCheck()
    loss_spike: LossSpikeCheck = LossSpikeCheck()
    padding_rows: PaddingRowsCheck = PaddingRowsCheck()
    coverage: CoverageCheck = CoverageCheck()
    untrained_rows: UntrainedRowsCheck = UntrainedRowsCheck()


