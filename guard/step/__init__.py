"""The host side, at a step boundary: the step clock, the reading, the verdict, the record
that feeds `g.stats` and the sinks, and the localisation of non-finite values."""

__all__: list[str] = []
