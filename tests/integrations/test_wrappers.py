"""Every wrapper a framework puts around a model (guard/wrappers.py, issue 33): attached to the
wrapper or to the module inside, the guard is the same one, hooks the module inside, and sees
labels given positionally, as the model's own forward takes them. A wrapper it does not know
is unwrapped by what it does, or refused with nothing hooked."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

import guard
from guard import AttachError, GuardViolation
from guard_server.testing import free_port
from tests.conftest import batch, hook_count, policy
from tests.integrations.nanogpt import REAL, nanogpt


class Forwarder(nn.Module):
    """A wrapper of nobody's: its forward hands everything to its only child."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)


class WithLoss(Forwarder):
    """... and one that also holds a module of its own: which does its forward call?"""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__(inner)
        self.criterion = nn.CrossEntropyLoss()


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A one-process gloo group, as torchrun gives a single rank (DDP needs one)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fabric(m: nn.Module) -> nn.Module:
    from lightning.fabric import Fabric

    wrapped: nn.Module = Fabric(accelerator="cpu", devices=1).setup_module(m)
    return wrapped


WRAPS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "DataParallel": DataParallel,
    "DistributedDataParallel": DistributedDataParallel,
    "Fabric": fabric,
    "unknown, one child": Forwarder,
    "nested: Fabric > unknown > DataParallel > compiled": lambda m: fabric(Forwarder(
        DataParallel(torch.compile(m, backend="eager")))),
}


@pytest.mark.parametrize("wrap", sorted(WRAPS))
@pytest.mark.parametrize("to", ["wrapper", "inner"])
def test_attached_to_the_wrapper_or_inside_it_is_one_guard(wrap: str, to: str,
                                                           request: pytest.FixtureRequest) -> None:
    if "Distributed" in wrap:
        request.getfixturevalue("one_rank")
    model = nanogpt(garbage=None)
    wrapped = WRAPS[wrap](model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with guard.attach(wrapped if to == "wrapper" else model, policy=policy(), vocab_size=REAL,
                      optimizer=opt) as g:
        assert g.model is model
        with pytest.raises(AttachError, match="already attached"):
            guard.attach(model if to == "wrapper" else wrapped, policy=policy())
        _, loss = wrapped(*batch(REAL))  # nanoGPT's train.py: model(X, Y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert g.stats["violations"] == {}  # the labels were seen: no coverage warning
        x, y = batch(REAL, seed=1)
        y[1, 2] = 110
        _, loss = wrapped(x, y)
        loss.backward()
        with pytest.raises(GuardViolation, match=r"token_range on rank 0 at step 2: 1 label"):
            opt.step()


def test_an_unknown_wrapper_is_said_at_info(caplog: pytest.LogCaptureFixture) -> None:
    model = nanogpt(garbage=None)
    with caplog.at_level(logging.INFO, logger="guard"), \
            guard.attach(Forwarder(model), policy=policy(), vocab_size=REAL) as g:
        assert g.model is model
    assert ("Forwarder (forward(*args, **kwargs), one child) is taken for a wrapper: the guard "
            "hooks its child 'inner' (GPT)") in caplog.text


def test_a_wrapper_around_several_children_is_refused_with_nothing_hooked() -> None:
    model = nanogpt(garbage=None)
    with pytest.raises(AttachError, match=r"cannot attach through WithLoss: it looks like a "
                       r"wrapper .*its child 'inner' holds all of its parameters.*inner \(GPT\), "
                       r"criterion \(CrossEntropyLoss\).*guard.attach\(wrapper.inner\)"):
        guard.attach(WithLoss(model), policy=policy(), vocab_size=REAL)
    assert hook_count(model) == 0
    with guard.attach(WithLoss(model).inner, policy=policy(), vocab_size=REAL) as g:
        assert g.model is model


def test_wrappers_past_eight_deep_are_refused() -> None:
    m: nn.Module = nanogpt(garbage=None)
    for _ in range(9):
        m = Forwarder(m)
    with pytest.raises(AttachError, match=r"more than 8 nested wrappers: Forwarder > Forwarder"):
        guard.attach(m, policy=policy())


# PEFT 0.18 (the last release that takes torchao 0.14, which torchtune needs) asks
# transformers 5 for a property it deprecates: PEFT's warning, not the guard's.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_peft_lora_is_unwrapped_to_the_model_and_guarded() -> None:
    peft = pytest.importorskip("peft")
    from tests.integrations.test_transformers import examples, gpt2, word_tokenizer

    tok = word_tokenizer()
    model = gpt2(len(tok))
    lora = peft.get_peft_model(model, peft.LoraConfig(
        r=4, target_modules=["c_attn"], fan_in_fan_out=True, task_type="CAUSAL_LM"))
    opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    data = examples(tok)
    with guard.attach(lora, policy=policy(), tokenizer=tok, optimizer=opt) as g:
        assert g.model is model
        with pytest.raises(AttachError, match="already attached"):
            guard.attach(lora.base_model, policy=policy())
        ids, labels = data[0]["input_ids"][None], data[0]["labels"][None]
        lora(ids, None, None, labels).loss.backward()  # labels at PeftModel's position 3
        opt.step()
        opt.zero_grad()
        assert g.stats["step"] == 1 and g.stats["violations"] == {}
        labels = labels.clone()
        labels[0, 2] = len(tok) + 3  # a ghost label
        lora(input_ids=ids, labels=labels).loss.backward()
        with pytest.raises(GuardViolation, match=r"token_range on rank 0 at step 2"):
            opt.step()


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_attached_inside_a_peft_model_the_guard_sees_its_calls_or_says_why_not(
        caplog: pytest.LogCaptureFixture) -> None:
    """PEFT's tuners up to 0.18 call the model's forward method, past its hooks: attached to the
    model inside, the guard says so at attach; a PEFT whose tuner calls the model is guarded
    from inside as from outside."""
    peft = pytest.importorskip("peft")
    from peft.tuners.tuners_utils import BaseTuner

    from tests.integrations.test_transformers import examples, gpt2, word_tokenizer

    tok = word_tokenizer()
    model = gpt2(len(tok))
    lora = peft.get_peft_model(model, peft.LoraConfig(
        r=4, target_modules=["c_attn"], fan_in_fan_out=True, task_type="CAUSAL_LM"))
    bypasses = "forward" in BaseTuner.forward.__code__.co_names
    data = examples(tok)[0]
    with caplog.at_level(logging.WARNING, logger="guard"), \
            guard.attach(model, policy=policy(), tokenizer=tok) as g:
        lora(input_ids=data["input_ids"][None], labels=data["labels"][None]).loss.backward()
        g.step()
    said = "holds PEFT adapters, and this PEFT's tuner calls its forward method directly"
    assert (said in caplog.text) is bypasses
    assert ("coverage" in g.stats["violations"]) is bypasses
