"""A trainer restarted under the same run_id and rank, as torchrun's elastic restarts do: the
server shows the new attach at once, not the old attach's higher step."""

from __future__ import annotations

import httpx
import pytest
import torch

import guard
from guard_server import EmbeddedServer, Settings
from tests.conftest import tiny_gpt
from tests.guard.sinks.helpers import serving, train_steps, wait_until


def _scrape(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=5).text


def test_a_restart_that_halts_is_visible_on_the_next_scrape() -> None:
    with EmbeddedServer(port=0, settings=Settings(port=0, log_level="warning")) as server:
        url = server.url
        assert url is not None
        labels = 'rank="0",run_id="sink-test"'
        p = serving(push=url)
        p["checks"]["nonfinite"] = {"action": "fail"}

        # The first attach gets to step 40, then its process dies: no detach, no final report.
        first_model = tiny_gpt()
        crashed = guard.attach(first_model, policy=p, vocab_size=100)
        train_steps(crashed, first_model, 40)
        assert wait_until(lambda: f"guard_step{{{labels}}} 40.0" in _scrape(url))

        # The restart halts at step 6 on a NaN, far behind step 40.
        model = tiny_gpt(seed=1)
        g = guard.attach(model, policy=p, vocab_size=100)
        train_steps(g, model, 5)
        with torch.no_grad():
            model.lm_head.weight[3, 0] = float("nan")
        with pytest.raises(guard.GuardViolation, match="nonfinite"):
            train_steps(g, model, 1)
        g.detach()
        text = _scrape(url)  # the next scrape after the restart's pushes have landed
        assert f'guard_halted{{check="nonfinite",{labels}}} 1.0' in text, text
        assert f"guard_step{{{labels}}} 6.0" in text
        crashed.detach()  # the test's own cleanup; its late final report is the old attach's


# A script that halts on `fail` and lets GuardViolation end the process, as scripts under
# torchrun do: no detach, no `with`. Run as `python -c` in a subprocess.
_HALTING_SCRIPT = """
import sys, torch, guard
from tests.conftest import tiny_gpt
from tests.guard.sinks.helpers import serving, train_steps
p = serving(push=sys.argv[1])
p["checks"]["nonfinite"] = {"action": "fail"}
model = tiny_gpt(seed=1)
g = guard.attach(model, policy=p, vocab_size=100)
train_steps(g, model, 5)
with torch.no_grad():
    model.lm_head.weight[3, 0] = float("nan")
train_steps(g, model, 1)  # raises GuardViolation, uncaught: the interpreter exits
"""


def test_a_halt_that_ends_the_process_still_reaches_the_server() -> None:
    import subprocess
    import sys

    from tests.dashboards.queries import ROOT

    with EmbeddedServer(port=0, settings=Settings(port=0, log_level="warning")) as server:
        url = server.url
        assert url is not None
        done = subprocess.run([sys.executable, "-c", _HALTING_SCRIPT, url], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 1 and "GuardViolation" in done.stderr
        # Sent before the interpreter went: the halted report (immediately) and the queue
        # (at exit), not left in the daemon thread's queue.
        text = _scrape(url)
        labels = 'rank="0",run_id="sink-test"'
        assert f'guard_halted{{check="nonfinite",{labels}}} 1.0' in text, text
        assert f"guard_step{{{labels}}} 6.0" in text
