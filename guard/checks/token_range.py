"""token_range: input ids and labels outside [0, real) (ghost ids [real, rows) and ids with no
row at all); the ignore index is exempt."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from guard.checks.spec import Context, Found, Raw, Setup, Slot, Spec, Stats, listed
from guard.policy import Policy
from guard_server.wire import ID_KINDS, IdKind

__all__ = ["INPUT", "LABEL", "NEGATIVE", "POSITIONS", "SLOTS", "SPEC", "TOP", "WIDTH",
           "TokenRange"]

# An id >= real and where it was, as one number a slot can max-combine over micro-batches
# and ranks and a float64 holds exactly: id * POSITIONS + its flat position in the forward's
# ids (guard/device/id_ops.py: out_of_range_parts); 0: none.
POSITIONS = 1 << 24

INPUT = Slot("token_range.input")  # input ids outside [0, real)
LABEL = Slot("token_range.label")  # labels outside [0, real), ignore index exempt
NEGATIVE = Slot("token_range.negative")  # of those labels, the ones below 0
SLOTS: Mapping[IdKind, Slot] = {"input": INPUT, "label": LABEL}
# Per kind, the highest id >= real with its position, and the last dimension of the ids it was
# in (the position as [row, column]).
TOP: Mapping[IdKind, Slot] = {k: Slot(f"token_range.top_{k}", "max") for k in ID_KINDS}
WIDTH: Mapping[IdKind, Slot] = {k: Slot(f"token_range.width_{k}", "max") for k in ID_KINDS}


@dataclass(frozen=True)
class TokenRange:
    counts: Mapping[IdKind, int]  # ids out of range per kind, as on the wire
    negative_labels: int
    max_id: int  # the highest id >= real of either kind; 0 when none
    where: Mapping[IdKind, str]  # per kind, the highest such id and its position, as text


def _where(key: float, width: float) -> tuple[int, str]:
    if key <= 0:
        return 0, ""
    top, flat = divmod(int(key), POSITIONS)
    at = f"[{flat // int(width)}, {flat % int(width)}]" if width > 0 else f"[{flat}]"
    return top, f"{top} at {at}"


def _figures(raw: Raw) -> TokenRange:
    found = {k: _where(raw[TOP[k]], raw[WIDTH[k]]) for k in SLOTS}
    return TokenRange({k: int(raw[slot]) for k, slot in SLOTS.items()}, int(raw[NEGATIVE]),
                      max(top for top, _ in found.values()),
                      {k: text for k, (_, text) in found.items() if text})


def _thresholds(policy: Policy, setup: Setup) -> Mapping[Slot, float]:
    return dict.fromkeys(SLOTS.values(), 0.0)


def _stats(f: TokenRange) -> Stats:
    return {"out_of_range": dict(f.counts)}


def _describe(f: TokenRange, c: Context) -> Found:
    seen, total = listed(f.counts, "{n} {k} id{s}", " and ")
    ignore = c.policy.checks.token_range.ignore_index
    exempt = "" if ignore is None else f" (ignore index {ignore} exempt)"
    why = []
    if (neg := f.negative_labels) > 0:
        why.append(f"{neg} label{'' if neg == 1 else 's'} {'is' if neg == 1 else 'are'} "
                   "negative: if they mark positions to ignore, set "
                   "checks.token_range.ignore_index to their value (nanoGPT ignores -1: "
                   "ignore_index: -1)")
    if c.real <= (top := f.max_id) < c.rows and c.real_from == "len(tokenizer)":
        why.append(f"ids in [{c.real}, {c.rows}) (highest {top}) are beyond the tokenizer you "
                   f"gave ({c.real} ids): ghost ids it cannot produce, so the data was made by "
                   "another tokenizer, or tokens were added to this one after the model was "
                   "resized (resize_token_embeddings to its new length)")
    elif c.real <= top < c.rows:
        # Just above real, these are often special tokens the size given leaves out, not bad
        # data: the message leads with the fix for that case.
        source = f" ({c.real_from})" if c.real_from else ""
        why.append(f"ids in [{c.real}, {c.rows}) (highest {top}) are beyond the real vocab "
                   f"{c.real}{source}: if your tokenizer has more ids (special tokens can sit "
                   "above a configured vocab size: Llama-3 reserves 256 ids above 128000 that "
                   "config.vocab_size leaves out, and litgpt's vocab_size alike), pass "
                   "tokenizer= or set vocab.real_size to its size; otherwise they are ghost "
                   "ids the tokenizer cannot produce")
    elif top >= c.rows:
        ignore = c.policy.checks.token_range.ignore_index
        why.append(f"ids >= {c.rows} (highest {top}) have no row at all: the guard replaced them "
                   f"on the device (input ids by 0, labels by the ignore index "
                   f"{-100 if ignore is None else ignore}, which must be the one the loss "
                   "ignores) so that the step ends here and not in an index error")
    if f.where:
        why.append("the highest: " + ", ".join(f"{'labels' if k == 'label' else 'input ids'} "
                                              f"{text}" for k, text in f.where.items()))
    kind = "+".join(k for k, n in f.counts.items() if n > 0) + (
        " without a row" if top >= c.rows else "")
    return Found(total, 0.0, kind=kind, text=(
        f"{seen} outside [0, {c.real}){exempt}: {'; '.join(why) or 'out of range'}; {c.next}. "
        f"Check the tokenizer / data pipeline against vocab {c.real}."))


SPEC = Spec("token_range", (INPUT, LABEL, NEGATIVE, *TOP.values(), *WIDTH.values()), _figures,
            _thresholds, ("inputs", "labels"), _stats, _describe)
