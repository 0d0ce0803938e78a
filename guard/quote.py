"""Values quoted for messages and logs, bounded and escaped: an input can neither blow a
message up (a 322-byte YAML alias bomb expands to gigabytes when written out whole) nor forge
a log line (a newline in a server's answer)."""

from __future__ import annotations

import reprlib

__all__ = ["quote", "shown"]

# Integers longer than this are named by their size: repr() of one past 4300 digits raises
# ValueError (sys.get_int_max_str_digits), and a long one says nothing a reader can use.
_INT_BITS = 256


class _Bounded(reprlib.Repr):
    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > _INT_BITS:
            return f"<an integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)


def quote(value: object, limit: int = 80) -> str:
    """`repr(value)` in at most `limit` characters (and `...`): a long string loses its middle,
    a long or deep container its tail; control characters and newlines are escaped."""
    short = _Bounded()
    short.maxstring = short.maxother = short.maxlong = limit
    short.maxlevel, short.maxdict = 2, 4
    short.maxlist = short.maxtuple = short.maxset = short.maxfrozenset = short.maxdeque = 4
    text = short.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shown(text: str, limit: int = 200) -> str:
    """`text` as it is when every character of it prints and it is short (a tensor name, a
    file name); else quoted and escaped (`quote`), so a newline cannot forge an output line
    and an escape sequence never reaches the terminal."""
    if text and len(text) <= limit and text.isprintable():
        return text
    return quote(text, limit)
