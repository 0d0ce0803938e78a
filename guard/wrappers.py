"""The model inside whatever wrapper a framework hands the user, in one place (the optimizer
side has its own: guard/step/optimizers.py). The guard hooks the module that a wrapper's
forward calls with the user's arguments, so attaching to the wrapper or to the module inside
is the same guard: the same hooks, and the labels' position read from that module's forward,
not from a wrapper's `forward(*args, **kwargs)`.

Known wrappers are named below by where their class lives, looked up in `sys.modules` and
never imported (a library that is not loaded wrapped nothing). Accelerate's prepared model is
one of them (DDP, FSDP, torch.compile) or the model itself, its forward patched in place with
`functools.wraps`, which keeps the signature. DeepSpeed's engine holds the model as `.module`
and its optimizer as `.optimizer`, which attach takes when given no `optimizer=` (the engine's
step is DeepSpeed's optimizer's, guard/step/zero.py). A wrapper the guard does not know is found by
what it does: its forward takes `(*args, **kwargs)`, it holds nothing of its own and its only
child is the model. One that looks like a wrapper but holds the model among other children is
refused: the guard cannot tell which child its forward calls."""

from __future__ import annotations

import inspect
import logging
import sys
from dataclasses import dataclass

from torch import nn

from guard.errors import AttachError

__all__ = ["KNOWN", "Known", "Unwrapped", "says_nothing", "unwrap", "unwrap_call",
           "unwrap_compiled"]

log = logging.getLogger("guard")

_DEPTH = 8  # wrappers inside wrappers: Fabric around DDP around a compiled module is three


@dataclass(frozen=True)
class Known:
    """A framework's wrapper: its class, and the attribute holding the module its forward
    calls with the arguments it was given."""

    module: str  # where the class lives (a key of sys.modules)
    name: str
    inner: str
    # Its forward may call the inner module's forward method rather than the module, past the
    # module's hooks (PEFT's tuners up to 0.18: `self.model.forward(...)`); read from its code.
    direct: bool = False
    optimizer: str = ""  # the attribute holding the optimizer it steps (DeepSpeed's engine)


KNOWN = (
    Known("torch.nn.parallel.distributed", "DistributedDataParallel", "module"),
    Known("torch.nn.parallel.data_parallel", "DataParallel", "module"),
    Known("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel",
          "module"),  # FSDP(1); FSDP2's fully_shard changes the module in place
    Known("torch._dynamo.eval_frame", "OptimizedModule", "_orig_mod"),  # torch.compile
    # fabric.setup(model): _forward_module is what forward calls (the model, or the strategy's
    # DDP / FSDP around it), _original_module the model as given.
    Known("lightning.fabric.wrappers", "_FabricModule", "_forward_module"),
    Known("lightning_fabric.wrappers", "_FabricModule", "_forward_module"),
    # PEFT: PeftModel.base_model is the tuner (LoraModel, ...) or, for prompt learning, the
    # model; a tuner's forward calls its .model with the same arguments.
    Known("peft.peft_model", "PeftModel", "base_model"),
    Known("peft.tuners.tuners_utils", "BaseTuner", "model", direct=True),
    # deepspeed.initialize's engine: forward(*inputs, **kwargs) calls .module with them.
    Known("deepspeed.runtime.engine", "DeepSpeedEngine", "module", optimizer="optimizer"),
)


@dataclass(frozen=True)
class Unwrapped:
    """The model under its wrappers, and the module whose forward hooks see each call."""

    model: nn.Module  # what the guard watches: found, sized and registered
    # The module whose hooks see the arguments and the output of each call: the model, unless
    # a wrapper calls the model's forward method past its hooks (then that wrapper).
    caller: nn.Module
    wrappers: tuple[str, ...] = ()  # class names, outermost first
    optimizer: object = None  # the optimizer a wrapper steps (DeepSpeed's engine), else None


def _known(model: object) -> tuple[Known, object] | None:
    for k in KNOWN:
        cls = getattr(sys.modules.get(k.module), k.name, None)
        if isinstance(cls, type) and isinstance(model, cls):
            return k, _inner(model, k.inner)
    return None


def _inner(model: object, attr: str) -> object:
    modules = getattr(model, "_modules", {})
    if attr in modules:  # a registered submodule (DDP's .module); FSDP's is a property
        return modules[attr]
    try:
        return getattr(model, attr, None)
    except KeyError:  # OptimizedModule's __getattr__, for an _orig_mod that was deleted
        return None


def says_nothing(module: nn.Module) -> bool:
    """Its forward names no parameter: `(*args, **kwargs)`, or nn.Module's unimplemented one."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


def _forwarded_to(module: nn.Module) -> nn.Module | None:
    """The child of an unknown module that does what a wrapper does, or None; an AttachError
    for one that looks like a wrapper around several children."""
    if not says_nothing(module) or any(True for _ in module.parameters(recurse=False)) \
            or any(True for _ in module.buffers(recurse=False)):
        return None
    children = list(module.named_children())
    if len(children) == 1:
        name, child = children[0]
        log.info("%s (forward(*args, **kwargs), one child) is taken for a wrapper: the "
                 "guard hooks its child %r (%s)", type(module).__name__, name,
                 type(child).__name__)
        return child
    every = set(module.parameters())
    holders = [n for n, c in children if every and set(c.parameters()) == every]
    if not holders:
        return None  # a model whose parts are its children: hooked as it is
    others = ", ".join(f"{n} ({type(c).__name__})" for n, c in children)
    raise AttachError(
        f"cannot attach through {type(module).__name__}: it looks like a wrapper (its forward "
        f"takes (*args, **kwargs) and its child {holders[0]!r} holds all of its parameters) but "
        f"it has other children too: {others}. The guard cannot tell which module its forward "
        f"calls nor where the labels go. Attach to the model inside "
        f"(guard.attach(wrapper.{holders[0]})), or give {type(module).__name__}.forward named "
        "parameters (labels= / targets=) to have it guarded as the model")


def unwrap_call(model: object) -> Unwrapped:
    """The module the guard hooks, `model` under every wrapper around it in any nesting, and
    the one whose hooks see each call (an AttachError names a wrapper it cannot reach
    through)."""
    names: list[str] = []
    caller: nn.Module | None = None
    optimizer: object = None
    for _ in range(_DEPTH):
        found = _known(model)
        if found is None:
            module = unwrap_compiled(model)  # refuses a compiled function and a non-module
            inner = _forwarded_to(module)
            if inner is None:
                if not names:
                    _warn_inside(module)
                return Unwrapped(module, caller or module, tuple(names), optimizer)
            names.append(type(module).__name__)
            model = inner
            continue
        known, reached = found
        names.append(type(model).__name__)
        if known.optimizer and optimizer is None:
            optimizer = getattr(model, known.optimizer, None)
        if known.name == "OptimizedModule":
            reached = unwrap_compiled(model)
        if not isinstance(reached, nn.Module):
            raise AttachError(
                f"cannot reach the model inside {' > '.join(names)}: its .{known.inner} is "
                f"{type(reached).__name__}, not a torch.nn.Module; attach to the model itself")
        if known.direct and _calls_forward_of(type(model)) and isinstance(model, nn.Module):
            caller = model  # the innermost such wrapper: every module outside it is called
        model = reached
    raise AttachError(f"more than {_DEPTH} nested wrappers: {' > '.join(names)}")


def unwrap(model: object) -> nn.Module:
    """The module the guard watches: `model` under every wrapper around it."""
    return unwrap_call(model).model


def _warn_inside(model: nn.Module) -> None:
    """Attached inside a wrapper that calls the model's forward past its hooks: said, since
    called through that wrapper the guard would see neither the labels nor the loss."""
    tuner = getattr(sys.modules.get("peft.tuners.tuners_utils"), "BaseTuner", None)
    if getattr(model, "peft_config", None) is not None and isinstance(tuner, type) \
            and _calls_forward_of(tuner):
        log.warning("%s holds PEFT adapters, and this PEFT's tuner calls its forward "
                    "method directly, past the guard's hooks: called through the PeftModel, "
                    "the guard sees neither the labels nor the loss. Attach to the PeftModel "
                    "(what get_peft_model returned) instead", type(model).__name__)


def _calls_forward_of(cls: type) -> bool:
    """Its forward looks up `.forward` on what it calls: `self.model.forward(*args)`."""
    forward = getattr(cls, "forward", None)
    code = None if forward is None else getattr(inspect.unwrap(forward), "__code__", None)
    return code is not None and "forward" in code.co_names


def unwrap_compiled(model: object) -> nn.Module:
    """The original module of a torch.compile'd one: the guard hooks it, and the compiled
    forward runs (and traces) those hooks. A module is returned as it is; anything else is an
    AttachError."""
    # Never imported: nothing was compiled.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
        orig = model._modules.get("_orig_mod", model.__dict__.get("_orig_mod"))
        if not isinstance(orig, nn.Module):
            raise AttachError(
                "cannot reach the original module of this torch.compile'd model (its _orig_mod "
                f"is {type(orig).__name__}); attach to the module itself, before or after "
                "compiling it: g = guard.attach(model); model = torch.compile(model)")
        return orig
    orig_fn = None if eval_frame is None else getattr(model, "_torchdynamo_orig_callable", None)
    if orig_fn is not None:
        owner = getattr(orig_fn, "__self__", None)
        what = (f"the compiled {type(owner).__name__}.{orig_fn.__name__}"
                if isinstance(owner, nn.Module) else f"a compiled {type(orig_fn).__name__}")
        raise AttachError(
            f"attach needs the model module, got {what} (a torch.compile'd function, not a "
            "module: the guard cannot reach the module it calls); attach to the module and "
            "compile the module: g = guard.attach(model); model = torch.compile(model)")
    if not isinstance(model, nn.Module):
        raise AttachError(f"attach needs a torch.nn.Module, got {type(model).__name__}")
    return model
