"""The guard's HTTP client library kept at WARNING (runs when a push sink opens, at attach):
httpx logs every request at INFO, one line per push, which would drown the guard's own lines
once a user turns on INFO logging. A level the user set on these loggers is kept."""

from __future__ import annotations

import logging

__all__ = ["QUIET_LOGGERS", "quiet_dependencies"]

QUIET_LOGGERS = ("httpx", "httpcore")


def quiet_dependencies() -> None:
    """Set WARNING on each of QUIET_LOGGERS that has no level of its own (NOTSET)."""
    for name in QUIET_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.WARNING)
