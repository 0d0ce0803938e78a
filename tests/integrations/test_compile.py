"""torch.compile: the guard measures and masks as in eager mode and adds no graph break.

The graph-break tests use the "eager" backend (dynamo's tracing without code generation: the
breaks are dynamo's, whatever the backend); one test runs inductor end to end.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

import guard
from guard import AttachError
from tests.conftest import batch, policy, tiny_gpt

# Batch shapes that change, so dynamo recompiles once for dynamic shapes: the guard must not
# add recompiles of its own on top (a new sampling offset each step did, up to the limit).
SHAPES = [(4, 16), (2, 16), (3, 8), (4, 16)]
SAMPLED = policy(padding_mass={"action": "mask", "sample_tokens": 8})


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def quiet_guard(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="guard")  # a mask warning per step is expected


def run(model: nn.Module, *, compiled: bool, mode: str | None, pol: dict[str, Any] = SAMPLED,
        backend: str = "eager", steps: int = len(SHAPES)) -> tuple[list[float], dict[str, Any]]:
    """Train `steps` SGD steps; mode None: no guard, else how the boundary is marked."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = None
    if mode is not None:
        g = guard.attach(model, policy=pol, vocab_size=100,
                         optimizer=opt if mode == "optimizer" else None)
    fwd = torch.compile(model, backend=backend) if compiled else model
    losses = []
    for i in range(steps):
        b, t = SHAPES[i % len(SHAPES)]
        _, loss = fwd(*batch(seed=i, b=b, t=t))
        loss.backward()
        if g is not None and mode == "step":
            g.step(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    stats = {}
    if g is not None:
        g.detach()
        stats = g.stats
    return losses, stats


def breaks() -> int:
    return sum(counters["graph_break"].values())


def frames() -> int:
    return counters["frames"]["total"]


@pytest.fixture(scope="module")
def unguarded_frames() -> int:
    """Frames dynamo compiles for the unguarded model over SHAPES; it breaks no graph."""
    torch._dynamo.reset()
    counters.clear()
    run(tiny_gpt(garbage=0.5), compiled=True, mode=None)
    assert breaks() == 0
    return frames()


@pytest.mark.parametrize("mode", ["optimizer", "step", "forward"])
def test_compiled_model_measures_and_masks_like_eager_without_graph_breaks(
        mode: str, unguarded_frames: int) -> None:
    eager_losses, eager_stats = run(tiny_gpt(garbage=0.5), compiled=False, mode=mode)
    torch._dynamo.reset()
    counters.clear()
    losses, stats = run(tiny_gpt(garbage=0.5), compiled=True, mode=mode)
    assert breaks() == 0 and not counters["unimplemented"]  # no break, no recompile limit
    # The same frames compile with and without the guard (its head hooks are in the forward's
    # graph, its model hooks run eagerly): no recompile of its own either.
    assert frames() == unguarded_frames
    assert losses == eager_losses  # the mask under compile: bitwise the eager numerics
    assert stats == eager_stats  # the same sampled rows: the offset is a tensor under compile
    assert stats["step"] == len(SHAPES) and stats["padding_mass"] > 0.05


def test_guarded_model_inside_a_fullgraph_function() -> None:
    m = tiny_gpt(garbage=0.5)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    eager = tiny_gpt(garbage=0.5)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)

    @torch.compile(backend="eager", fullgraph=True)  # any graph break raises
    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return m(x, y)[1]

    with guard.attach(m, policy=SAMPLED, vocab_size=100, optimizer=opt) as g, \
            guard.attach(eager, policy=SAMPLED, vocab_size=100, optimizer=eager_opt) as ge:
        for i in range(3):
            for fn, o in ((loss_of, opt), (lambda x, y: eager(x, y)[1], eager_opt)):
                fn(*batch(seed=i)).backward()
                o.step()
                o.zero_grad()
        assert g.stats == ge.stats and g.stats["step"] == 3


def test_attach_to_an_already_compiled_module() -> None:
    m = tiny_gpt(garbage=0.5)
    compiled = torch.compile(m, backend="eager")
    with guard.attach(compiled, policy=SAMPLED, vocab_size=100) as g:
        assert g.model is m and g.lm_head is m.lm_head  # hooks on the original
        with pytest.raises(AttachError, match="already attached"):
            guard.attach(m, policy=SAMPLED, vocab_size=100)
        compiled(*batch())
        compiled.eval()
        with torch.no_grad():
            logits, _ = compiled(batch(seed=1)[0])
        assert torch.isneginf(logits[..., 100:]).all() and torch.isfinite(logits[..., :100]).all()
    assert g.stats["step"] == 1 and g.stats["padding_mass"] > 0.05
    assert breaks() == 0


def test_unreachable_original_module_is_an_attach_error() -> None:
    m = tiny_gpt()
    with pytest.raises(AttachError, match=r"compiled GPT\.forward .*guard\.attach\(model\); "
                       r"model = torch\.compile\(model\)"):
        guard.attach(torch.compile(m.forward, backend="eager"), policy=SAMPLED)
    with pytest.raises(AttachError, match="got a compiled function"):
        guard.attach(torch.compile(lambda x: m(x), backend="eager"), policy=SAMPLED)
    compiled = torch.compile(m, backend="eager")
    del compiled._orig_mod  # e.g. a wrapper that dropped it
    with pytest.raises(AttachError, match=r"cannot reach the original module.*attach to the "
                       "module itself"):
        guard.attach(compiled, policy=SAMPLED)


class Tiny(nn.Module):
    """Embedding -> tanh -> lm_head: the smallest model inductor compiles in seconds."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(128, 16)
        self.lm_head = nn.Linear(16, 128, bias=False)
        with torch.no_grad():
            self.lm_head.weight[100:] = torch.randn(28, 16)  # garbage padding rows

    def forward(self, idx: torch.Tensor,
                targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self.lm_head(torch.tanh(self.wte(idx)))  # (B, T, 128)
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1),
                                                            targets.flatten())
        return logits, loss


def test_aot_autograd_trains_like_eager() -> None:
    exact = policy(padding_mass={"action": "mask", "exact": True})
    eager_losses, eager_stats = run(Tiny(), compiled=False, mode="optimizer", pol=exact, steps=3)
    losses, stats = run(Tiny(), compiled=True, mode="optimizer", pol=exact, steps=3,
                        backend="aot_eager")  # AOT autograd's forward and backward graphs
    assert breaks() == 0
    assert losses == pytest.approx(eager_losses, rel=1e-6)
    assert stats["padding_mass"] == pytest.approx(eager_stats["padding_mass"], rel=1e-6)
    assert stats["violations"] == eager_stats["violations"] == {}  # the mask did its job


@pytest.mark.slow
# Importing inductor touches torch.jit.script_method, deprecated in torch 2.13: torch's own.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("gcc") is None,
                    reason="inductor on the CPU needs a C++ compiler")
def test_inductor_measures_and_masks_like_eager() -> None:
    """Forward only (training mode, no grad): inductor compiles a backward too slowly here."""
    out = {}
    for compiled in (False, True):
        m = Tiny()
        fwd = torch.compile(m, backend="inductor") if compiled else m
        pol = policy(padding_mass={"action": "mask", "exact": True})
        with guard.attach(m, policy=pol, vocab_size=100) as g, torch.no_grad():
            for i in range(2):
                logits, loss = fwd(*batch(seed=i))
                g.step(loss)
        out[compiled] = (logits, loss, g.stats)
    (e_logits, e_loss, e_stats), (logits, loss, stats) = out[False], out[True]
    assert breaks() == 0
    assert torch.isneginf(logits[..., 100:]).all()
    assert torch.allclose(logits[..., :100], e_logits[..., :100], rtol=1e-5, atol=1e-6)
    assert float(loss) == pytest.approx(float(e_loss), rel=1e-5)
    assert stats["padding_mass"] == pytest.approx(e_stats["padding_mass"], rel=1e-4)
    assert stats["violations"] == e_stats["violations"] == {}  # the mask did its job


# -- compiled before attach: the graph traced without the hooks must not go on running --------


def nanogpt_steps(fwd: Callable[..., Any], opt: torch.optim.Optimizer, steps: int,
                  after_each: Any = None) -> list[float]:
    losses = []
    for i in range(steps):
        _, loss = fwd(*batch(seed=i))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        if after_each is not None:
            after_each()
    return losses


@pytest.mark.parametrize("how", ["torch.compile", "model.compile"])
def test_nanogpt_compiled_and_warmed_up_before_attach_is_guarded(how: str) -> None:
    from tests.integrations.nanogpt import REAL, nanogpt

    mask = policy(padding_mass={"action": "mask"})
    eager = nanogpt()
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    with guard.attach(eager, policy=mask, vocab_size=REAL, optimizer=eager_opt) as ge:
        eager_losses = nanogpt_steps(eager, eager_opt, 3)

    m = nanogpt()
    fwd: nn.Module = m
    if how == "torch.compile":
        fwd = torch.compile(m, backend="aot_eager")
    else:
        m.compile(backend="aot_eager")
    m.eval()
    with torch.no_grad():  # nanoGPT's estimate_loss() before the first step
        fwd(*batch(seed=9))
    m.train()
    fwd(*batch(seed=9))  # and a training forward: the graph is traced, without hooks
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    seen: list[int] = []
    with guard.attach(fwd, policy=mask, vocab_size=REAL, optimizer=opt) as g:
        losses = nanogpt_steps(fwd, opt, 3, after_each=lambda: seen.append(frames()))
    assert g.stats["padding_mass"] is not None and g.stats["padding_mass"] > 0.05
    assert g.stats["violations"] == ge.stats["violations"] == {}  # the mask did its job
    assert losses == pytest.approx(eager_losses, rel=1e-5)  # masked, as in eager mode
    assert seen[0] == seen[-1]  # one recompile at attach, none per step
    assert breaks() == 0
    # Detached, the compiled model runs without the hooks again: unmasked, like eager.
    m.eval()
    with torch.no_grad():
        logits, _ = fwd(*batch(seed=1))
    assert torch.isfinite(logits[..., REAL:]).all()


def test_compiled_step_function_traced_before_attach_is_retraced_with_the_hooks() -> None:
    """A function that calls the model, compiled and warmed up before attach: its graph
    inlined the model's forwards, so no code of the model has a cache entry to drop."""
    from tests.integrations.nanogpt import REAL, nanogpt

    m = nanogpt()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)

    @torch.compile(backend="aot_eager")
    def fwd(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return m(x, y)

    fwd(*batch(seed=9))[1].backward()  # the warm-up: traced without the guard's hooks
    opt.zero_grad()
    stop = policy(padding_mass={"action": "fail"})
    with pytest.raises(guard.GuardViolation, match=r"padding_mass on rank 0 at step 1: .* "
                       r"stopping \(action: fail\)"), \
            guard.attach(m, policy=stop, vocab_size=REAL, optimizer=opt):
        nanogpt_steps(fwd, opt, 3)

    before, seen = frames(), []
    mask = policy(padding_mass={"action": "mask"})
    with guard.attach(m, policy=mask, vocab_size=REAL, optimizer=opt) as g:
        nanogpt_steps(fwd, opt, 3, after_each=lambda: seen.append(frames()))
    assert g.stats["loss"] is not None and g.stats["padding_mass"] > 0.05
    assert g.stats["violations"] == {}  # the mask did its job
    # One recompile after the detach of the failed guard, none per step (the step's loss kept
    # alive into the next forward, as nanogpt_steps does, is no graph input).
    assert seen == [before + 1] * 3
    assert breaks() == 0
    logits, _ = fwd(*batch(seed=1))  # detached: retraced without the hooks, unmasked again
    assert torch.isfinite(logits[..., REAL:]).all()


def test_nanogpt_ignore_index_minus_one_gets_a_message_that_names_the_fix() -> None:
    from tests.integrations.nanogpt import REAL, nanogpt

    m = nanogpt(garbage=None)
    x, y = batch()
    y[:, -2:] = -1  # nanoGPT's F.cross_entropy(..., ignore_index=-1)
    with guard.attach(m, policy=policy(), vocab_size=REAL) as g, \
            pytest.raises(guard.GuardViolation, match=r"8 labels are negative: .*set "
                          r"checks\.token_range\.ignore_index to their value \(nanoGPT "
                          r"ignores -1: ignore_index: -1\)"):
        m(x, y)[1].backward()
        g.step()
    pol = policy(token_range={"ignore_index": -1})
    with guard.attach(m, policy=pol, vocab_size=REAL) as g:
        m(x, y)[1].backward()
        g.step()
        assert g.stats["out_of_range"] == {"input": 0, "label": 0}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("gcc") is None,
                    reason="inductor on the CPU needs a C++ compiler")
def test_inductor_graph_from_a_warm_up_is_replaced_at_attach() -> None:
    """The issue's case: inductor, a forward before attach; forward only (see above)."""
    m = Tiny()
    fwd = torch.compile(m, backend="inductor")
    with torch.no_grad():
        unmasked, _ = fwd(*batch(seed=0))  # the warm-up: traced without the guard's hooks
    assert torch.isfinite(unmasked[..., 100:]).all()
    pol = policy(padding_mass={"action": "mask", "exact": True})
    with guard.attach(fwd, policy=pol, vocab_size=100) as g, torch.no_grad():
        logits, loss = fwd(*batch(seed=0))
        g.step(loss)
    assert torch.isneginf(logits[..., 100:]).all()
    assert g.stats["padding_mass"] is not None and g.stats["padding_mass"] > 0.05
    assert g.stats["violations"] == {}  # the mask did its job


def test_nanogpt_label_without_a_row_ends_in_the_guards_message() -> None:
    """nanoGPT's loss ignores -1: with that ignore index in the policy, a label past the rows
    becomes -1 on the device, and the step ends in the guard's message, not in torch's
    `Target 5000 is out of bounds`."""
    from tests.integrations.nanogpt import REAL, nanogpt

    m = nanogpt(garbage=None)
    x, y = batch()
    y[2, 7] = 5000
    y[:, -1] = -1  # nanoGPT's own ignore value, left as it is
    with guard.attach(m, policy=policy(token_range={"ignore_index": -1}), vocab_size=REAL) as g, \
            pytest.raises(guard.GuardViolation, match=r"1 label id outside \[0, 100\) \(ignore "
                          r"index -1 exempt\): ids >= 128 \(highest 5000\) have no row at all.*"
                          r"labels 5000 at \[2, 7\]"):
        m(x, y)[1].backward()
        g.step()


def untrained_gpt() -> nn.Module:
    """The tiny GPT with four real rows of its tied weight never trained (zero)."""
    m = tiny_gpt(garbage=0.5)
    with torch.no_grad():
        m.lm_head.weight[90:94] = 0.0
    return m


def test_untrained_rows_are_counted_and_repaired_under_compile_as_in_eager() -> None:
    pol = policy(untrained_rows={"action": "repair"})
    eager_losses, eager_stats = run(untrained_gpt(), compiled=False, mode="optimizer", pol=pol)
    torch._dynamo.reset()
    counters.clear()
    losses, stats = run(untrained_gpt(), compiled=True, mode="optimizer", pol=pol)
    assert breaks() == 0 and not counters["unimplemented"]  # the lookup is in the graph
    assert losses == eager_losses and stats == eager_stats
    assert stats["untrained_tokens"]["input"] > 0  # random batches use ids 90-93
    assert stats["violations"]["untrained_rows"]["repair"] >= 1
