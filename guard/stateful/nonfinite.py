"""The nonfinite check's state: the gradients the optimizer applies, checked at each step
boundary before the update (guard/device/grads.py reduces them on the device; where the loop
clips, from the clip's own norms, taken before the clip: guard/device/clip.py), the total norm
and its largest parameter as figures, and at a violation the parameters named."""

from __future__ import annotations

import torch.distributed as dist

from guard.checks import grads, nonfinite
from guard.device.clip import tap
from guard.device.grads import GradNorms
from guard.device.hooks import Handle
from guard.device.reading import Reading
from guard.stateful.stages import born_on_a_stage
from guard.stateful.state import Attaching, CheckState
from guard.vocab.stage import Stage

__all__ = ["GradState"]

_NAMED = 5  # parameters named one by one in a message; the rest are counted


class GradState(CheckState):
    spec = nonfinite.SPEC
    at_detach = False  # sharded, a collective

    def __init__(self, norms: GradNorms, names: list[str]) -> None:
        self.norms = norms
        self.names = names  # per parameter of `norms`, the model's own name for it
        self.stage: Stage | None = None  # a pipeline stage: the names are gathered by stage

    @classmethod
    def attach(cls, at: Attaching) -> GradState | None:
        """The optimizer's parameters (every group's), or the model's trainable ones when the
        loop gives g.step() instead, or when the optimizer steps copies of its own (DeepSpeed's
        ZeRO gives the torch optimizer flat fp32 partitions, none of the model's parameters;
        their gradients are found through the model's, guard/device/zero_grads.py). None:
        nothing trains."""
        model = [p for p in at.model.parameters() if p.requires_grad]
        params = ([p for g in at.optimizer.param_groups for p in g["params"]]
                  if at.optimizer is not None else model)
        mine = {id(p) for p in model}
        if not any(id(p) in mine for p in params):
            params = model
        if not params:
            return None
        named: dict[int, str] = {}
        for name, p in at.model.named_parameters(remove_duplicate=False):
            named.setdefault(id(p), name)
        names = [named.get(id(p), f"optimizer parameter {i}") for i, p in enumerate(params)]
        state = cls(GradNorms(params, at.flags, scaled=at.scaled), names)
        state.stage = at.stage
        return state

    def install(self) -> list[Handle]:
        """The loop's gradient clip hands its per-parameter norms over (guard/device/clip.py):
        taken before it spreads a NaN, in place of a second read of the gradients."""
        return [tap(self.norms)]

    def end_step(self) -> None:
        self.norms.measure()

    def check(self) -> None:
        self.norms.before_read()

    def stats(self, reading: Reading) -> dict[str, str | None]:
        top = reading.local[grads.SPEC].top
        return {"grad_norm_top": None if top is None else self.names[top]}

    def detail(self, reading: Reading, *, reduce: bool) -> str:
        """The parameters whose gradient holds a NaN/Inf on any rank (one read of one number
        per parameter, at a violation; combined over ranks when `reduce`: every rank of the
        job asks at the same read, its gradients sharded or not)."""
        if not reading.glob[nonfinite.SPEC].counts.get("grad"):
            return ""
        bad = self.norms.named_bad()
        hit = [self.names[i] for i, b in enumerate(bad.tolist()) if b > 0]  # a violation
        if reduce and self.stage is not None:
            return born_on_a_stage(hit, len(self.names), self.stage, _NAMED)
        if reduce and dist.is_available() and dist.is_initialized() and \
                dist.get_world_size() > 1:
            # The names, not a tensor per parameter: the ranks of a pipeline's stages hold
            # different parameters (and a sharded one's NaN may sit on another rank's shard).
            every: list[list[str] | None] = [None] * dist.get_world_size()
            dist.all_gather_object(every, hit)
            hit = list(dict.fromkeys(n for names in every for n in names or ()))
        if not hit:
            return ""
        first = ", ".join(hit[:_NAMED])
        more = f" and {len(hit) - _NAMED} more" if len(hit) > _NAMED else ""
        return (f"the gradient{'s' if len(hit) > 1 else ''} of {first}{more} "
                f"({len(hit)} of {len(self.names)} parameters)")
