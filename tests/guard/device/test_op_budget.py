"""The default policy's work a step, counted rather than timed (tests never assert on wall time):
the device ops the guard adds to a training step, against a budget, and no host read inside it.

Why a count: on the CPU, between the model's large ops, each of the guard's small ops costs
several microseconds of host time (its kernel's code and data are cold again), so their number
is most of what the guard's hooks cost beyond the two reads that are the checks themselves
(the sample's logsumexp, the gradients' norms): docs/benchmarks.md, "Fewer ops a step". A
change that adds ops to every step fails here and has to say why in the budget below.

The step is the bench model's shape at a small size: 1024 positions a forward, so the sample
is 32 of them and issue 39's hottest rows are measured beside it, AdamW, the default policy.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import guard
from tests.conftest import tiny_gpt

# Ops a step the default policy adds, as torch dispatches them (composites as their parts):
# 304 before issue 40's last cut (the flags' per-put views, isfinite's four ops, the labels'
# masks formed twice), 230 after it. Raise it only for a check worth its ops, and say so in
# docs/benchmarks.md.
BUDGET = 240


class _Ops(TorchDispatchMode):
    """Every op dispatched while active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.names[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def ops_a_step(guarded: bool) -> collections.Counter[str]:
    """The ops of the fourth training step (forward, backward, AdamW, zero_grad) of a tiny GPT,
    with the default policy attached or not."""
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = guard.attach(model, vocab_size=100, optimizer=opt,
                     policy={"export": {"serve": None}}) if guarded else None
    gen = torch.Generator().manual_seed(0)

    def step() -> None:
        x = torch.randint(0, 100, (32, 33), generator=gen)  # 32 x 32 positions
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    try:
        for _ in range(3):  # buffers made, the loss window started
            step()
        with _Ops() as ops:
            step()
    finally:
        if g is not None:
            g.detach()
    return ops.names


@pytest.fixture(scope="module")
def counted() -> tuple[collections.Counter[str], collections.Counter[str]]:
    """(the guarded step's ops, the unguarded step's)."""
    logger = logging.getLogger("guard")
    level = logger.level
    logger.setLevel(logging.ERROR)  # the tiny model's padding mass warns
    try:
        return ops_a_step(True), ops_a_step(False)
    finally:
        logger.setLevel(level)


def test_the_default_policy_adds_at_most_its_budget_of_ops_a_step(
        counted: tuple[collections.Counter[str], collections.Counter[str]]) -> None:
    guarded, baseline = counted
    added = sum(guarded.values()) - sum(baseline.values())
    assert added > 50, "the count sees the guard's ops"  # it measures something
    assert added <= BUDGET, (
        f"the default policy adds {added} ops a step, over its budget of {BUDGET}: "
        f"{(guarded - baseline).most_common(12)}")


def test_no_host_read_inside_a_step_but_the_boundarys(
        counted: tuple[collections.Counter[str], collections.Counter[str]]) -> None:
    # The boundary's read is a list copy of the flags (Flags._wait: no op dispatched); an
    # .item(), a bool(t) or a tensor indexed by a 0-dim tensor on the CPU is
    # _local_scalar_dense, which the static scan (test_hot_path.py) cannot see in indexing.
    # AdamW's own are the baseline's (its step counts, read per parameter on the CPU).
    guarded, baseline = counted
    assert guarded["_local_scalar_dense"] == baseline["_local_scalar_dense"]


def test_the_count_finds_an_added_op_and_a_host_read() -> None:
    # The mode counts what runs under it, reads included: what the two tests rely on.
    t = torch.arange(4.0)
    with _Ops() as ops:
        index = t.argmax()
        _ = t[index] + 1  # a 0-dim tensor as an index: a host read on the CPU
    assert ops.names["_local_scalar_dense"] == 1 and ops.names["add"] == 1
