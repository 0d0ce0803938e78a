"""The host side, at a step boundary: the step clock, the reading, the verdict, the record
that feeds `g.stats` and the sinks, and the localisation of non-finite values; between steps,
the guard's state saved with a checkpoint and restored at a resume (`resume.py`)."""

__all__: list[str] = []
