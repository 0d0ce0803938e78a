"""One read of the flags, as the host sees it: plain numbers named as on the wire."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Reading", "Values"]


@dataclass(frozen=True)
class Values:
    """The per-step values of one read window; counts are those of the window, not cumulative."""

    padding_mass: float | None = None  # mean over the sampled positions; None: none sampled
    padding_mass_max: float | None = None
    nonfinite: dict[str, int] = field(
        default_factory=lambda: {"logits": 0, "hidden": 0, "loss": 0})
    out_of_range: dict[str, int] = field(default_factory=lambda: {"input": 0, "label": 0})
    loss: float | None = None  # the step's loss; None: no loss was seen
    spike_ratio: float = 0.0  # loss / median of the history at the worst spike, else 0
    # Training steps of the window in which no logits / labels / loss reached the guard.
    blind: dict[str, int] = field(default_factory=lambda: {"logits": 0, "labels": 0, "loss": 0})
    fused: int = 0  # forwards measured from the final hidden states: the head was not called
    negative_labels: int = 0  # of out_of_range["label"], those below 0
    max_id: int = 0  # the highest out-of-range id >= real; 0 when none
    rows_nonfinite: int = 0  # non-finite values in the padding rows of the weights
    rows_ratio: float = 0.0  # their largest norm over the largest real row's (inf: non-finite)


@dataclass(frozen=True)
class Reading:
    """This rank's values, the values max-combined over all ranks, and per per-step check the
    highest rank past its threshold (None: no rank). Every rank reads the same `glob` and
    `over`, so every rank takes the same decision; on a single process `glob` is `local`."""

    local: Values
    glob: Values
    over: dict[str, int | None]

    def fired(self, check: str) -> int | None:
        """The highest rank on which `check` crossed its threshold, or None."""
        return self.over.get(check)
