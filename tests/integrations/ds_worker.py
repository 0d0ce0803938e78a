"""One rank of the DeepSpeed tests (tests/integrations/test_deepspeed.py); not a test itself.

usage: python -m torch.distributed.run --nproc-per-node 2 ... ds_worker.py OUT_DIR STAGE

DeepSpeed on the CPU (DS_ACCELERATOR=cpu, gloo), ZeRO stage STAGE (2 or 3). Every case of
CASES runs on both ranks, each from a fresh GPT-2 (real vocab 1000 in 1024 rows) and a fresh
engine, through the raw engine loop (`deepspeed.initialize`, `engine.backward`, `engine.step`)
and through the HF Trainer (`TrainingArguments(deepspeed=...)`, tests/integrations/
ds_trainer.py); OUT_DIR/rank<N>.json holds each case's result, keyed "<entry>/<case>".
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for tests.*

import deepspeed
from transformers import GPT2Config, GPT2LMHeadModel

import guard
from tests.guard.test_backward_nan import NaNBackward
from tests.integrations.dist_worker import Logged, finish

REAL, ROWS, STEPS, FAULT_STEP = 1000, 1024, 3, 2


def gpt2(garbage: float | None = None) -> GPT2LMHeadModel:
    """1 layer, d=32, tied; rows [1000, 1024) mean-resized as HF does (healthy), or garbage."""
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=REAL, n_embd=32, n_layer=1, n_head=2, n_positions=32,
                     bos_token_id=0, eos_token_id=0, pad_token_id=1)
    m = GPT2LMHeadModel(cfg)
    m.resize_token_embeddings(REAL, pad_to_multiple_of=64)
    if garbage is not None:  # what an uninitialised resize can leave in the padding rows
        with torch.no_grad():
            m.lm_head.weight[REAL:] = torch.randn(ROWS - REAL, 32) * garbage
    return m


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, REAL, (2, 16), generator=torch.Generator().manual_seed(
        100 * step + rank))


def config(stage: int, *, auto: bool = False) -> dict[str, Any]:
    size: Any = "auto" if auto else 2
    return {"train_micro_batch_size_per_gpu": size, "gradient_accumulation_steps":
            "auto" if auto else 1, "zero_optimization": {"stage": stage},
            "steps_per_print": 10**9, "wall_clock_breakdown": False}


def policy(**checks: dict[str, Any]) -> dict[str, Any]:
    return {"export": {"serve": None}, "checks": checks}


def rows(model: torch.nn.Module) -> list[list[float]]:
    """The padding rows as the model holds them (gathered where ZeRO-3 partitioned them)."""
    w = model.get_output_embeddings().weight
    with deepspeed.zero.GatheredParameters([w]):
        return w.detach()[REAL:].tolist()


def padding(model: torch.nn.Module) -> dict[str, Any]:
    """The padding rows' norms as the model and as DeepSpeed's fp32 copy hold them (both
    ranks: gathered), against the largest real row's."""
    from deepspeed.utils import safe_get_full_fp32_param

    w = model.get_output_embeddings().weight
    with deepspeed.zero.GatheredParameters([w]):
        held = w.detach().clone()
    master = safe_get_full_fp32_param(w).detach()
    real = held[:REAL].norm(dim=-1).amax().item()
    return {"model": held[REAL:].norm(dim=-1).amax().item() / real,
            "master": master[REAL:].norm(dim=-1).amax().item() / real,
            "rows": held[REAL:].tolist()}


def fault(model: torch.nn.Module, kind: str | None, now: dict[str, int]) -> None:
    """At FAULT_STEP: `ghost` (a label of rank 1 in the padding ids), `nan-logits` (rank 0's
    logits NaN), `nan-backward` (rank 1's first block: a NaN gradient, the forward finite),
    `spike` (rank 0's loss 100 times its own: finite gradients, 100 times too large)."""
    rank = dist.get_rank()

    def logits(module: Any, args: Any, out: torch.Tensor) -> Any:
        return out * float("nan") if now["step"] == FAULT_STEP and rank == 0 else None

    def backward(module: Any, args: Any, out: Any) -> Any:
        if now["step"] != FAULT_STEP or rank != 1:
            return None
        if isinstance(out, tuple):
            return (NaNBackward.apply(out[0]), *out[1:])
        return NaNBackward.apply(out)

    def spike(module: Any, args: Any, out: Any) -> Any:
        if now["step"] == FAULT_STEP and rank == 0 and module.training:
            out["loss"] = out["loss"] * 100.0
        return out

    if kind == "spike":
        model.register_forward_hook(spike)
    if kind == "nan-logits":
        model.lm_head.register_forward_hook(logits)
    elif kind == "nan-backward":
        model.transformer.h[0].register_forward_hook(backward)


def labels(x: torch.Tensor, kind: str | None, step: int) -> torch.Tensor:
    y = x.clone()
    if kind == "ghost" and step == FAULT_STEP and dist.get_rank() == 1:
        y[0, 3] = REAL + 5  # a padding id: no token of the tokenizer
    return y


class Moments:
    """A sink: at each report (inside the read, after a repair, before the update) the largest
    |exp_avg| this rank holds of the padding rows (-1 before the optimizer has any; None where
    this rank's partition holds none of them)."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w, self.seen = w, list[float | None]()

    def emit(self, batch: Any) -> None:
        self.seen.append(padding_moment(self.w))

    def close(self, timeout: float = 5.0) -> None:
        pass


def padding_moment(w: Any) -> float | None:
    from deepspeed.utils import safe_get_local_optimizer_state

    lo, hi = REAL * 32, ROWS * 32  # the padding rows' elements of the flattened weight
    if hasattr(w, "ds_id"):
        n = w.ds_tensor.ds_numel
        at, size = n * dist.get_rank(), n
        try:
            m = safe_get_local_optimizer_state(w, "exp_avg")
        except (KeyError, TypeError):
            return -1.0
    else:
        mapping = w._hp_mapping
        if not mapping.optim_fragment:
            return -1.0
        at, size = mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel
        m = mapping.optim_fragment["exp_avg"]
    s, e = max(lo, at), min(hi, at + size)
    return m[s - at : e - at].abs().max().item() if s < e else None


def diverge(model: torch.nn.Module) -> None:
    """Garbage written into the padding rows of the model and of DeepSpeed's fp32 copy alike,
    on both ranks (what a bad update leaves), for the next read to find."""
    from deepspeed.utils import safe_set_full_fp32_param

    w = model.get_output_embeddings().weight
    garbage = torch.randn(ROWS - REAL, 32, generator=torch.Generator().manual_seed(3))
    with deepspeed.zero.GatheredParameters([w], modifier_rank=0), torch.no_grad():
        w.data.view(ROWS, 32)[REAL:] = garbage
        full = w.detach().clone()
    safe_set_full_fp32_param(w, full)


# case: (garbage, policy, fault); the healthy and the repair cases attach differently per entry.
CASES: dict[str, tuple[float | None, dict[str, Any], str | None]] = {
    "healthy": (None, policy(), None),
    "padding-fail": (1.0, policy(padding_mass={"action": "fail"},
                                 padding_rows={"action": "off"}), None),
    "mask": (1.0, policy(padding_rows={"action": "off"}), None),
    "repair": (1.0, policy(), None),
    "ghost": (None, policy(), "ghost"),
    "nan-logits": (None, policy(), "nan-logits"),
    "nan-backward": (None, policy(), "nan-backward"),
    "spike-skip": (None, policy(loss_spike={"action": "skip", "warmup": 1, "window": 2}),
                   "spike"),
    # The padding rows trained (no mask), then garbage after step 1: repaired at step 2's read.
    "repair-later": (None, policy(padding_mass={"action": "warn"}), "diverge"),
}


TRAINER = [name for name in CASES if name != "repair-later"]  # the engine's own loop only


def engine_case(stage: int, name: str) -> dict[str, Any]:
    """The raw engine loop: attached to the engine (healthy: to the module before initialize,
    with the torch optimizer; ghost: to the module with the engine's optimizer)."""
    garbage, pol, kind = CASES[name]
    model = gpt2(garbage)
    start = rows(model)
    now = {"step": 0}
    fault(model, kind, now)
    decay = [p for n, p in model.named_parameters() if "ln" not in n and "bias" not in n]
    rest = [p for n, p in model.named_parameters() if "ln" in n or "bias" in n]
    opt = torch.optim.AdamW([{"params": decay}, {"params": rest}], lr=1e-2, weight_decay=0.0)
    calls = {"inner": 0}
    opt.register_step_pre_hook(lambda *a: calls.__setitem__("inner", calls["inner"] + 1))
    g = guard.attach(model, policy=pol, vocab_size=REAL, optimizer=opt) \
        if name == "healthy" else None
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config(stage))
    if name == "ghost":
        g = guard.attach(model, policy=pol, vocab_size=REAL, optimizer=engine.optimizer)
    elif g is None:
        g = guard.attach(engine, policy=pol, vocab_size=REAL)
    out: dict[str, Any] = {"raised": None, "losses": []}
    moments = Moments(model.get_output_embeddings().weight)
    g.add_sink(moments)
    try:
        for step in range(1, STEPS + 1):
            now["step"] = step
            x = batch(step, dist.get_rank())
            loss = engine(input_ids=x, labels=labels(x, kind, step)).loss
            out["losses"].append(loss.item())
            engine.backward(loss)
            before = [p.detach().clone() for p in masters(model)]
            engine.step()
            if step == FAULT_STEP:  # what a skipped update left
                out["unchanged"] = all(torch.equal(a, b) for a, b in
                                       zip(before, masters(model), strict=True))
            if kind == "diverge" and step == 1:
                diverge(model)
    except guard.GuardViolation as e:
        out["raised"] = {"check": e.check, "step": e.step, "rank": e.rank, "message": str(e),
                         "unchanged": all(torch.equal(a, b) for a, b in
                                          zip(before, masters(model), strict=True))}
    out.update(stats=g.stats, inner_calls=calls["inner"], reference=_real_loss(name),
               start=start, moments=moments.seen)
    if name in ("mask", "repair", "healthy", "repair-later"):
        out["padding"] = padding(model)
    g.detach()
    return out


def masters(model: torch.nn.Module) -> list[torch.Tensor]:
    """DeepSpeed's fp32 copy of every parameter, as this rank holds it (what the update moves)."""
    from deepspeed.utils import safe_get_local_fp32_param

    ps = list(model.parameters())
    if hasattr(ps[0], "ds_id"):
        return [safe_get_local_fp32_param(p) for p in ps]
    return [p._hp_mapping.hp_fragment for p in ps if p._hp_mapping is not None]


def _real_loss(name: str) -> float | None:
    """The step-1 loss of a head over the real vocab only, on this rank's batch (mask)."""
    if name != "mask":
        return None
    m = gpt2(1.0)
    x = batch(1, dist.get_rank())
    logits = m(input_ids=x).logits[..., :REAL]
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, REAL),
                                             x[:, 1:].reshape(-1)).item()


def main(out: Path, stage: int) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    said = Logged()
    logging.getLogger("guard").addHandler(said)
    from tests.integrations.ds_trainer import trainer_case

    result: dict[str, Any] = {}
    for entry, run in (("engine", engine_case), ("trainer", trainer_case)):
        for name in CASES if entry == "engine" else TRAINER:
            said.lines.clear()
            result[f"{entry}/{name}"] = {**run(stage, name), "said": list(said.lines)}
    finish(out, dist.get_rank(), result)


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main(Path(sys.argv[1]), int(sys.argv[2]))
