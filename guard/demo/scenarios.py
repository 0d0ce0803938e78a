"""The demo's two scenarios: what is in the padding rows, and what an earlier search found.
No torch here: `guard demo --help` lists them (guard/demo/padded.py builds the models).

seed  The seed's story: a head padded from 50000 to 50016 rows whose 16 padding rows hold
      large but finite garbage (an untied lm_head, as Llama-style models have, resized
      without initialising the new rows). The loss stays finite and falls like learning.
nan   Uninitialised memory as torch.empty can hand back: arbitrary float32 bit patterns,
      up to ~3e38. The loss is NaN/Inf at step 1, which every NaN check already catches.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["REAL", "ROWS", "SCENARIOS", "Scenario"]

REAL = 50000  # the seed's vocabulary
ROWS = 50016  # the seed's padded size (not a multiple of 64: 50000 pads to 50048)


@dataclass(frozen=True)
class Scenario:
    """One way the padding rows go wrong."""

    name: str
    tied: bool
    summary: str  # one line for `guard demo --help`
    garbage: str  # what the padding rows hold, for the console
    # What bench/demo_ingredients.py found looking for what turns this into a NaN: said as
    # that search's result, not this run's ("" when there was no search). What the run itself
    # shows is computed from it (guard/demo/text.py).
    searched: str


SCENARIOS = {
    "seed": Scenario(
        "seed",
        tied=False,
        summary="large but finite garbage in an untied head's padding rows, as a resize "
        "without initialisation leaves: the loss stays finite and stalls, no NaN check "
        "fires, the guard fires at step 1",
        garbage="rows [50000, 50016) of the untied lm_head hold large but finite garbage "
        "(normal, std 5: 250x the real rows' init), as a resize that does not initialise "
        "the new rows can leave them",
        searched="bench/demo_ingredients.py looked for the ingredient that turns this into "
        "a NaN on this model: float16 and bfloat16 autocast, learning rates up to 3e-2, "
        "garbage up to std 20, tied and untied heads (21 runs); none went NaN within 80 "
        "steps.",
    ),
    "nan": Scenario(
        "nan",
        tied=True,
        summary="uninitialised float32 bit patterns in the tied rows: NaN at step 1, which "
        "every detector catches; the guard also names the first module that went non-finite",
        garbage="rows [50000, 50016) of the tied embedding / lm_head hold uninitialised "
        "memory: arbitrary float32 bit patterns (finite ones, up to ~3e38)",
        searched="",
    ),
}
