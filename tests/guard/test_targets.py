"""Slurm hostlist expansion and the file_sd target groups of `guard targets`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from guard.cli import main
from guard.targets import MAX_HOSTS, expand_hostlist, target_groups


@pytest.mark.parametrize(
    ("spec", "hosts"),
    [
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("node7", ["node7"]),
        ("a,b c", ["a", "b", "c"]),  # commas and whitespace separate, as in scontrol
        ("gpu[8-10]", ["gpu8", "gpu9", "gpu10"]),  # no padding: the lower bound has none
        ("gpu[008-010]", ["gpu008", "gpu009", "gpu010"]),
        ("n[1,3],m[2-3]", ["n1", "n3", "m2", "m3"]),  # commas inside brackets do not split
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
        ("node[1-2].cluster.local", ["node1.cluster.local", "node2.cluster.local"]),
    ],
)
def test_expand_hostlist(spec: str, hosts: list[str]) -> None:
    assert expand_hostlist(spec) == hosts


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("node[01-04", "'[' not closed"),
        ("node]", "']' without '['"),
        ("node[[1]]", "nested '['"),
        ("node[]", "empty brackets"),
        ("node[4-1]", "runs backwards"),
        ("node[a-b]", "expected N or N-M"),
        ("node[1-2,]", "expected N or N-M"),
        ("node1,node1", "names node1 twice"),
        ("  ", "names no host"),
        ("node:1", "not a host name"),
        (f"n[0-{MAX_HOSTS}]", f"more than {MAX_HOSTS}"),
        ("a[0-999]b[0-999]", f"more than {MAX_HOSTS}"),  # the product is bounded too
    ],
)
def test_expand_hostlist_errors_name_the_problem(spec: str, says: str) -> None:
    with pytest.raises(ValueError, match=says.replace("[", r"\[")):
        expand_hostlist(spec)


def test_target_groups_one_per_node_one_target_per_rank() -> None:
    groups = target_groups(["n1", "n2"], 8, 9464, {"guard_run_id": "r1"})
    assert groups[1] == {
        "targets": [f"n2:{port}" for port in range(9464, 9472)],
        "labels": {"node": "n2", "guard_run_id": "r1"},
    }
    assert sum(len(g["targets"]) for g in groups) == 16


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"ranks_per_host": 0}, "ranks per host"),
        ({"port": 65530}, "not all in 1..65535"),  # 65530 + 7 > 65535
        ({"labels": {"run_id": "r1"}}, "'run_id' is reserved"),
        ({"labels": {"rank": "0"}}, "'rank' is reserved"),
        ({"labels": {"__address__": "x"}}, "not a Prometheus target label name"),
        ({"labels": {"bad-name": "x"}}, "not a Prometheus target label name"),
    ],
)
def test_target_groups_refuse(kwargs: dict[str, object], says: str) -> None:
    args: dict[str, object] = {"hosts": ["n1"], "ranks_per_host": 8} | kwargs
    with pytest.raises(ValueError, match=says):
        target_groups(**args)  # type: ignore[arg-type]


def test_cli_prints_the_file_sd_json(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["targets", "--nodes", "gpu[1-2]", "--gpus-per-node", "2", "--port", "9500",
                 "--run-id", "llm-7b", "--label", "cluster=a"])
    assert code == 0
    assert json.loads(capsys.readouterr().out) == [
        {"targets": ["gpu1:9500", "gpu1:9501"],
         "labels": {"node": "gpu1", "cluster": "a", "guard_run_id": "llm-7b"}},
        {"targets": ["gpu2:9500", "gpu2:9501"],
         "labels": {"node": "gpu2", "cluster": "a", "guard_run_id": "llm-7b"}},
    ]


def test_cli_reads_the_slurm_nodelist_and_writes_atomically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[07-08]")
    out = tmp_path / "job-42.json"
    assert main(["targets", "--gpus-per-node", "8", "--out", str(out)]) == 0
    groups = json.loads(out.read_text())
    assert [g["labels"]["node"] for g in groups] == ["node07", "node08"]
    assert [p.name for p in tmp_path.iterdir()] == ["job-42.json"]  # no temporary left


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--gpus-per-node", "8"], "give --nodes"),
        (["--nodes", "n[2-1]", "--gpus-per-node", "8"], "runs backwards"),
        (["--nodes", "n1", "--gpus-per-node", "8", "--label", "nolabel"], "expected NAME=VALUE"),
        (["--nodes", "n1", "--gpus-per-node", "8", "--label", "rank=3"], "'rank' is reserved"),
        (["--nodes", "n1", "--gpus-per-node", "8", "--out", "/nonexistent/dir/x.json"],
         "cannot write"),
    ],
)
def test_cli_bad_input_exits_2(capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch, argv: list[str], says: str) -> None:
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    assert main(["targets", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("guard targets: ") and says in err
