"""Two ranks under torchrun (gloo, CPU): one violation, one decision, no hang; nanoGPT under
DDP and under FSDP2 (fully_shard), whose weights are DTensors sharded by rows."""

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


def run_ranks(tmp_path: Path, mode: str, env: dict[str, str] | None = None, *,
              nproc: int = 2, worker: Path = WORKER) -> tuple[list[dict[str, Any]], int]:
    """Every rank's results, and the first /metrics port (dist_worker.py's; another worker
    is given OUT_DIR and MODE only)."""
    serve = free_ports(nproc)  # port + LOCAL_RANK for each rank
    args = [str(serve), mode] if worker == WORKER else [mode]
    args = ["--rdzv-id", RUN_ID, str(worker), str(tmp_path), *args]
    return run_ranks_with(tmp_path, args, env, TIMEOUT_S, nproc=nproc), serve


def run_ranks_with(tmp_path: Path, args: list[str], env: dict[str, str] | None,
                   timeout: float, *, nproc: int = 2) -> list[dict[str, Any]]:
    """torchrun with `nproc` ranks on `args` (a worker script and its arguments), killed whole
    after `timeout` seconds; each rank's JSON result from tmp_path/rank<N>.json."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_ports(1)), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    # Its own session, so a hang is killed whole: torchrun and both ranks.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"a rank hung: torchrun still running after {timeout} s\n{err[-4000:]}")
    assert proc.returncode == 0, err[-4000:]  # every rank exited, none crashed
    return [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(nproc)]


def assert_both_stopped_at_the_ghost(res: dict[str, Any], i: int, attach: int = 0,
                                     per_read: int = 0) -> None:
    """`attach`: the all-reduces at attach (FSDP2: untrained_rows gathers the features of the
    rows each rank holds, once per weight); `per_read`: besides the read's own (FSDP2: the
    total gradient norm sums every rank's shards, one number)."""
    assert (res["rank"], res["guard_rank"]) == (i, i)
    assert res["run_id"] == RUN_ID  # TORCHELASTIC_RUN_ID
    # Both raise at step 3, naming rank 1, though rank 0 saw nothing wrong.
    assert (res["raised_at"], res["check"], res["step"], res["violation_rank"]) == \
        (3, "token_range", 3, 1)
    assert res["message"].startswith("token_range on rank 1 at step 3: 1 label id")
    # One all-reduce per step read (3 steps): the read at detach is local, since a rank may
    # detach alone (after an exception) and must not hang the rest.
    assert res["counts"]["read"] == 4
    assert res["counts"]["all_reduce"] == 3 * (1 + per_read) + attach


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


@pytest.mark.slow
@DIST
def test_nanogpt_under_fsdp2_stops_both_ranks_at_the_ghost_label(tmp_path: Path) -> None:
    # fully_shard each Block, then the root, in place: the guard is attached to the
    # FSDPModule itself. Its hooks see the gathered weights, its labels the model's forward.
    r, _ = run_ranks(tmp_path, "fsdp2")
    for i, res in enumerate(r):
        assert_both_stopped_at_the_ghost(res, i, attach=1, per_read=1)  # FSDP2's own aside


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """dist_worker.py's FSDP2_CHECKS, both ranks' results, from one torchrun."""
    return run_ranks(tmp_path_factory.mktemp("fsdp2"), "fsdp2-checks")[0]


@pytest.mark.slow
@DIST
def test_fsdp2_padding_rows_are_checked_and_repaired_on_each_shard_without_a_gather(
        fsdp2: list[dict[str, Any]]) -> None:
    # 64 rows split at row 32, real 20: rank 0 holds 12 padding rows, rank 1 32 and no real row.
    for i, res in enumerate(fsdp2):
        rows = res["padding_rows"]
        assert "padding_rows" not in rows["clean_violations"]  # none on rank 1's shard either
        assert (rows["fail"]["check"], rows["fail"]["step"], rows["fail"]["rank"]) == \
            ("padding_rows", 0, 1)
        assert rows["fail"]["message"].startswith(
            "padding_rows on rank 1 at step 0: rows [20, 64) of transformer.wte.weight (tied: "
            "lm_head.weight): the largest norm ")
        assert "x the largest real row's, expected finite and <= 10x" in rows["fail"]["message"]
        assert rows["fail_left_rows"]  # fail changes nothing
        # repair: each rank sets the padding rows it holds to the mean of the whole weight's
        # real rows (rank 1 holds none of them); the real rows stay as they were.
        assert rows["mean_local_rows"] == (12, 32)[i] and rows["repaired"]
        # Garbage written into rank 0's shard after step 1 is seen at the step 2 read and
        # repaired; each read costs the guard's one all-reduce and the total gradient norm's
        # (the shards' squares summed), the repair one more (the sum of the real rows), and no
        # read gathers the weight.
        assert rows["violations"]["padding_rows"] == {"repair": 2}
        assert rows["step_collectives"] == [{"c10d.allreduce_": n} for n in (2, 3, 2)]
        assert rows["no_garbage_after_training"]


@pytest.mark.slow
@DIST
def test_fsdp2_mask_trains_as_the_real_vocab_model(fsdp2: list[dict[str, Any]]) -> None:
    # The reference: the same weights without the 28 padding rows, trained in one process on
    # both ranks' batches (FSDP2 averages the ranks' gradients, as DDP does).
    masked = [res["mask"] for res in fsdp2]
    reference = masked[0]["reference"]
    assert masked[1]["reference"] == reference
    for step, ref in enumerate(reference):
        assert (masked[0]["losses"][step] + masked[1]["losses"][step]) / 2 == \
            pytest.approx(ref, abs=1e-5)
    for res in masked:
        stats = res["stats"]
        # Measured before the mask, on every step; nothing else fired and no check was blind.
        assert stats["padding_mass"] > 0.1
        assert stats["violations"] == {}  # the mask did its job
        # Unmasked, healthy padding rows are no violation, even under fail: both ranks train
        # on, with the loss the padding columns' healthy share inflates (-log(1 - 28/128)).
        assert res["fail"] is None
    unmasked = (masked[0]["unmasked_loss"] + masked[1]["unmasked_loss"]) / 2
    assert unmasked > reference[0] + 0.1


@pytest.mark.slow
@DIST
def test_fsdp2_nan_stops_both_ranks_and_its_localising_rerun_changes_no_step(
        fsdp2: list[dict[str, Any]]) -> None:
    for i, res in enumerate(fsdp2):
        nan = res["nonfinite"]
        fail = nan["fail-2"]
        assert (fail["check"], fail["step"], fail["rank"]) == ("nonfinite", 2, 0)
        assert "Localisation: every module output was finite on a re-run" in fail["message"]
        # The re-run is a forward without grad between backward and the update, after which
        # FSDP2 keeps the weights gathered: the guard reshards them, or step 3 would run on
        # the weights from before step 2's update.
        assert nan["warn-2"]["losses"] == nan["warn-None"]["losses"]
        assert nan["warn-2"]["stats"]["violations"]["nonfinite"] == {"warn": 1}
        assert nan["warn-2"]["stats"]["nonfinite"]["loss"] == (1, 0)[i]  # rank 0's NaN


@pytest.mark.slow
@DIST
def test_fsdp2_untrained_rows_are_found_whole_and_repaired_where_any_rank_used_them(
        fsdp2: list[dict[str, Any]]) -> None:
    # Found at attach from both shards (one all-reduce of the rows' features), as one vocab.
    for res in (r["untrained"] for r in fsdp2):
        assert res["found"] == {"embedding": 10, "lm_head": 10}  # tied: named twice
        # Each rank used one id; both ranks repaired both (the ids used are max-reduced), each
        # writing the rows it holds, to the mean of the whole weight's trained rows.
        assert res["repaired"] == [61, 66]
        assert res["zero"] == [60, 62, 63, 64, 65, 67, 68, 69]
        assert res["stats"]["untrained_rows"] == {"embedding": 8, "lm_head": 8}
        assert res["stats"]["untrained_tokens"] == {"input": 1, "label": 0}  # this rank's
        assert res["stats"]["violations"] == {"untrained_rows": {"repair": 1}}


def hash_seeds_that_order_two_names_apart(first: str, second: str) -> tuple[int, int]:
    """Two PYTHONHASHSEEDs under which a set built from `first` then `second` iterates in
    different orders (str hashing is randomised per process)."""
    code = f"s = set(); s.add({first!r}); s.add({second!r}); print(*s)"
    orders: dict[str, int] = {}
    for seed in range(64):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={**os.environ, "PYTHONHASHSEED": str(seed)}, check=True)
        orders.setdefault(done.stdout.strip(), seed)
        if len(orders) == 2:
            a, b = orders.values()
            return a, b
    raise AssertionError("no two seeds order the names apart")


@pytest.mark.slow
@DIST
def test_repairs_at_one_read_run_in_the_same_order_on_every_rank(tmp_path: Path) -> None:
    # Both repairs are collectives under FSDP2; ranks whose hash seeds order a set of check
    # names apart would run them in different orders (mismatched all-reduces: a hang or
    # wrong rows) if the reader took their order from a set.
    seeds = hash_seeds_that_order_two_names_apart("untrained_rows", "padding_rows")
    results, _ = run_ranks(tmp_path, "repair-order",
                           {"GUARD_TEST_HASHSEEDS": ",".join(map(str, seeds))})
    for res in results:
        assert res["violations"] == {"untrained_rows": {"repair": 1},
                                     "padding_rows": {"repair": 1}}
        assert res["untrained_repaired"] == [61, 66]
        assert res["padding_repaired"]


@pytest.mark.slow
@DIST
@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_a_nan_born_in_one_ranks_backward_stops_or_skips_every_rank(tmp_path: Path,
                                                                     wrap: str) -> None:
    results, _ = run_ranks(tmp_path, f"nan-grad-{wrap}")
    for res in results:
        fail, skip = res["fail"], res["skip"]
        # Both ranks stop at the step whose backward went NaN on rank 1, before its update.
        assert fail["raised_at"] == 2 and fail["unchanged"] and fail["finite"]
        v = fail["violation"]
        assert (v["check"], v["step"]) == ("nonfinite", 2)
        assert "born in the backward" in v["message"] and "transformer.h.0" in v["message"]
        # skip: both drop that update and train on, the weights finite.
        assert skip["raised_at"] is None and skip["finite"]
        assert skip["stats"]["skipped_steps"] == 1
        assert skip["stats"]["violations"] == {"nonfinite": {"skip": 1}}
    if wrap == "ddp":  # one set of gradients: the same figures on both ranks
        assert results[0]["skip"]["stats"] == results[1]["skip"]["stats"]


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_a_fused_optimizer_drops_the_same_update_on_every_rank(tmp_path: Path,
                                                               wrap: str) -> None:
    """With a fused AdamW the NaN step's update is dropped on the device on both ranks (the
    decision from the all-reduced flags, no host read before it); fail raises at the next read,
    step 3's, naming step 2, with step 3's update not applied either."""
    results, _ = run_ranks(tmp_path, f"nan-grad-{wrap}-fused")
    for res in results:
        fail, skip = res["fail"], res["skip"]
        assert fail["raised_at"] == 3 and fail["unchanged"] and fail["dropped"]
        assert (fail["violation"]["check"], fail["violation"]["step"]) == ("nonfinite", 2)
        assert skip["raised_at"] is None and skip["dropped"] and skip["finite"]
        assert skip["stats"]["skipped_steps"] == 1
