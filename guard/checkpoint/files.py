"""The one way a checkpoint's files are opened: regular files only (a FIFO would block, a link
to /dev/zero never ends, a socket or device is no file), at most a bound of bytes, and every
failure a CheckpointError naming the file and what it should hold."""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from guard.checkpoint.read_limits import ENV, limits
from guard.errors import CheckpointError

__all__ = ["load_json", "opened", "read_bytes"]

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


@contextmanager
def opened(path: Path, what: str, missing: str = "missing") -> Iterator[tuple[int, int]]:
    """(file descriptor, size) of `path`, a regular file (a link is followed only to one);
    `missing` says what an absent one is."""
    # O_NONBLOCK: opening a FIFO for reading would wait for a writer; on a regular file it
    # changes nothing. O_NOCTTY: a terminal device never becomes ours.
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise CheckpointError(str(path), f"{missing}; expected {what}") from None
    except OSError as e:
        raise CheckpointError(str(path), f"cannot read ({e.strerror or e}); expected {what}") \
            from None
    except ValueError:  # a NUL byte in the name
        raise CheckpointError(repr(str(path)), f"a file name with a NUL byte; expected {what}") \
            from None
    try:
        mode, size = (st := os.fstat(fd)).st_mode, st.st_size
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "a special file")
            raise CheckpointError(str(path), f"{kind}, not a regular file; expected {what}")
        yield fd, size
    finally:
        os.close(fd)


def read_bytes(path: Path, what: str, limit: int | None = None) -> bytes:
    """The whole of `path`, a regular file of at most `limit` bytes (GUARD_CHECKPOINT_MAX_
    FILE_BYTES by default)."""
    limit = limits().file_bytes if limit is None else limit
    with opened(path, what) as (fd, size):
        if size > limit:
            raise CheckpointError(str(path), f"{size} bytes, over the {limit}-byte bound "
                                  f"({ENV['file_bytes']}); expected {what}")
        try:
            # One byte past the size fstat gave: a file that grew since is read to the bound
            # and said, never past it.
            data = os.read(fd, size + 1)
            while len(data) <= limit and (more := os.read(fd, limit + 1 - len(data))):
                data += more
        except OSError as e:
            raise CheckpointError(str(path), f"cannot read ({e.strerror or e}); expected "
                                  f"{what}") from None
    if len(data) > limit:
        raise CheckpointError(str(path), f"over the {limit}-byte bound ({ENV['file_bytes']}); "
                              f"expected {what}")
    return data


def load_json(path: Path, what: str) -> Any:
    """The JSON in `path`, or a CheckpointError naming the file and `what` it should hold."""
    raw = read_bytes(path, what)
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(str(path), f"not valid JSON ({e}); expected {what}") from None
    except RecursionError:
        raise CheckpointError(str(path), f"not valid JSON (nested too deep to read); expected "
                              f"{what}") from None
    except ValueError:  # an integer of more digits than int() reads
        raise CheckpointError(str(path), f"not valid JSON (an integer of more than "
                              f"{sys.get_int_max_str_digits()} digits); expected {what}") from None
