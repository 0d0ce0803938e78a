"""The Slurm / bare-metal recipe: `guard targets` feeding file_sd, sharded by hashmod.

deploy/slurm/prometheus.yml is checked by promtool with a targets file that `guard targets`
wrote, then run by two real Prometheus servers configured as shards 0 and 1 of 2: together
they discover every rank once. deploy/slurm/guard-job.sbatch runs with stand-ins for srun and
scontrol, and the real `guard`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from guard.cli import main
from guard_server.testing import free_port, prometheus_binary
from tests.dashboards.conftest import Run
from tests.dashboards.queries import ROOT, alert_rules

SLURM = ROOT / "deploy/slurm"
NODES, GPUS, PORT = "127.0.0.[1-3]", 4, 19464  # loopback "nodes": nothing needs to listen


def deploy_copy(root: Path, *, modulus: int = 1, shard: int = 0) -> Path:
    """deploy/ copied under root (the config's relative paths hold), with the targets of
    NODES written by `guard targets`, as shard `shard` of `modulus`; the config's path."""
    shutil.copytree(ROOT / "deploy", root / "deploy")
    config = root / "deploy/slurm/prometheus.yml"
    text = config.read_text()
    assert text.count("modulus: 1") == 1 and text.count('regex: "0"') == 1
    config.write_text(text.replace("modulus: 1", f"modulus: {modulus}")
                      .replace('regex: "0"', f'regex: "{shard}"'))
    (config.parent / "guard-targets").mkdir()
    out = config.parent / "guard-targets/job-1.json"
    argv = ["targets", "--nodes", NODES, "--gpus-per-node", str(GPUS), "--port", str(PORT),
            "--run-id", "run.1", "--out", str(out)]
    assert main(argv) == 0
    return config


@pytest.mark.prometheus
def test_promtool_accepts_the_config_with_generated_targets(tmp_path: Path, run: Run) -> None:
    config = deploy_copy(tmp_path)
    result = run("promtool", "check", "config", config.name, cwd=config.parent)
    output = result.stdout + result.stderr
    rules = len(alert_rules(ROOT / "deploy/prometheus/guard-alerts-by-run.yml"))
    assert "SUCCESS: prometheus.yml is valid" in output
    assert f"SUCCESS: {rules} rules found" in output
    assert "WARNING" not in output  # the file_sd glob matched the generated file, and parsed


@contextmanager
def prometheus(config: Path) -> Iterator[str]:
    """A real Prometheus on `config`; yields its base URL."""
    binary = prometheus_binary()
    if binary is None:
        pytest.skip("prometheus not installed (Debian package prometheus; scripts/bootstrap --dev)")
    url = f"http://127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory(prefix="guard-prometheus-") as data:
        process = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={data}",
             f"--web.listen-address={url.split('//')[1]}", "--log.level=error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            yield url
        finally:
            process.terminate()
            process.wait(timeout=10)


def active_targets(url: str, want: int, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """The active targets, once discovery has delivered them (it batches updates ~5 s)."""
    deadline = time.monotonic() + timeout_s
    found: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        try:
            reply = httpx.get(f"{url}/api/v1/targets", timeout=2.0)
            # 503 until Prometheus is ready (it is still starting): asked again, as a refusal.
            if reply.status_code == 200:
                found = reply.json()["data"]["activeTargets"]
                dropped = reply.json()["data"]["droppedTargets"]
                if len(found) + len(dropped) >= want:
                    return found
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url}: {len(found)} targets after {timeout_s} s")


@pytest.mark.prometheus
def test_two_shards_split_the_ranks_between_them(tmp_path: Path) -> None:
    total = 3 * GPUS
    configs = [deploy_copy(tmp_path / str(shard), modulus=2, shard=shard) for shard in (0, 1)]
    with prometheus(configs[0]) as url0, prometheus(configs[1]) as url1:
        shards = [active_targets(url, total) for url in (url0, url1)]
    addresses = [{t["discoveredLabels"]["__address__"] for t in shard} for shard in shards]
    assert addresses[0] and addresses[1] and not addresses[0] & addresses[1]
    expected = {f"127.0.0.{n}:{PORT + i}" for n in (1, 2, 3) for i in range(GPUS)}
    assert addresses[0] | addresses[1] == expected
    for target in shards[0] + shards[1]:
        labels = target["labels"]
        assert labels["job"] == "guard-ranks" and labels["guard_run_id"] == "run.1"
        assert labels["instance"].startswith(labels["node"] + ":")
        assert not {"run_id", "rank"} & set(labels)  # the guard's own labels stay the guard's


STUBS = {
    # scontrol show hostnames LIST: the expansion, as Slurm prints it.
    "scontrol": "#!/usr/bin/env bash\nprintf 'node01\\nnode02\\n'\n",
    # srun: records its arguments and the targets file as it is while the job runs.
    "srun": "#!/usr/bin/env bash\necho \"$@\" > \"$STUB_LOG/srun.args\"\n"
            "cp \"$GUARD_TARGETS_DIR/$SLURM_JOB_ID.json\" \"$STUB_LOG/targets.json\"\n",
}


def test_sbatch_script_writes_the_targets_for_the_job_and_removes_them(tmp_path: Path) -> None:
    bin_dir, targets, log = tmp_path / "bin", tmp_path / "targets", tmp_path / "log"
    for d in (bin_dir, targets, log):
        d.mkdir()
    for name, text in STUBS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "llm", "SLURM_JOB_NODELIST": "node[01-02]",
        "SLURM_NNODES": "2", "GUARD_TARGETS_DIR": str(targets), "STUB_LOG": str(log),
    }
    subprocess.run(["bash", str(SLURM / "guard-job.sbatch")], env=env, check=True, timeout=60)
    groups = json.loads((log / "targets.json").read_text())
    assert [g["labels"] for g in groups] == [
        {"node": n, "slurm_job_id": "4242", "guard_run_id": "llm-4242"}
        for n in ("node01", "node02")
    ]
    assert groups[1]["targets"] == [f"node02:{9464 + i}" for i in range(8)]
    args = (log / "srun.args").read_text().split()
    assert args[:1] == ["torchrun"] and "node01:29500" in args and "llm-4242" in args
    assert list(targets.iterdir()) == []  # removed when the job ended
