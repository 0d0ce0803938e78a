"""Two ranks under torchrun (gloo, CPU): one violation, one decision, no hang."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

WORKER = Path(__file__).with_name("dist_worker.py")
RUN_ID = "logitguard-torchrun-test"
TIMEOUT_S = 120  # two CPU ranks finish in ~10 s; a hang is killed, not waited on


def free_ports(n: int) -> int:
    """The first of n consecutive free loopback ports."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        socks = []
        try:
            for p in range(first, first + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def run_ranks(tmp_path: Path, mode: str) -> tuple[list[dict[str, Any]], int]:
    """Both ranks' results, and the first /metrics port."""
    serve = free_ports(2)  # port + LOCAL_RANK for each rank
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_ports(1)),
           "--rdzv-id", RUN_ID, str(WORKER), str(tmp_path), str(serve), mode]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # Its own session, so a hang is killed whole: torchrun and both ranks.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"a rank hung: torchrun still running after {TIMEOUT_S} s\n{err[-4000:]}")
    assert proc.returncode == 0, err[-4000:]  # both ranks exited, neither crashed
    return [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1)], serve


def assert_both_stopped_at_the_ghost(res: dict[str, Any], i: int) -> None:
    assert (res["rank"], res["guard_rank"]) == (i, i)
    assert res["run_id"] == RUN_ID  # TORCHELASTIC_RUN_ID
    # Both raise at step 3, naming rank 1, though rank 0 saw nothing wrong.
    assert (res["raised_at"], res["check"], res["step"], res["violation_rank"]) == \
        (3, "token_range", 3, 1)
    assert res["message"].startswith("token_range on rank 1 at step 3: 1 label ids")
    # One all-reduce per step read (3 steps): the read at detach is local, since a rank may
    # detach alone (after an exception) and must not hang the rest.
    assert res["counts"]["read"] == 4 and res["counts"]["all_reduce"] == 3


DIST = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                          reason="needs torch.distributed with gloo")


@pytest.mark.slow
@DIST
def test_violation_on_rank_1_stops_both_ranks_at_the_same_step(tmp_path: Path) -> None:
    r, serve = run_ranks(tmp_path, "tiny")
    for i, res in enumerate(r):
        assert_both_stopped_at_the_ghost(res, i)
        assert res["counts"]["other_collectives"] == 0  # none anywhere else
        # The embedded endpoint on port + LOCAL_RANK, labelled with the run and the rank.
        assert res["metrics_url"] == f"http://127.0.0.1:{serve + i}/metrics"
        steps = [line for line in res["metrics"].splitlines() if line.startswith("guard_step{")]
        assert len(steps) == 1 and steps[0].endswith(" 2.0")  # read at step 2, this rank only
        assert f'rank="{i}"' in steps[0] and f'run_id="{RUN_ID}"' in steps[0]


@pytest.mark.slow
@DIST
@pytest.mark.parametrize("mode", ["ddp-wrapper", "ddp-module"])
def test_nanogpt_under_ddp_is_guarded_whether_attached_to_the_wrapper_or_the_module(
        tmp_path: Path, mode: str) -> None:
    # nanoGPT's model.py in DistributedDataParallel, called as its train.py does: model(X, Y).
    # DDP's forward(*inputs) hides `targets`: the guard unwraps it to find the label position.
    r, _ = run_ranks(tmp_path, mode)
    for i, res in enumerate(r):
        assert_both_stopped_at_the_ghost(res, i)
