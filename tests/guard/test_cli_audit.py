"""`guard audit PATH`: output, --json, options and exit status 0 / 1 / 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from guard.cli import SIGPIPE_STATUS, main
from tests.guard.checkpoint.test_checkpoint import write_model


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "clean": write_model(root / "clean", 100, real=100, resize_to=128),
        "unaligned": write_model(root / "unaligned", 100, real=100),
        "untied": write_model(root / "untied", 128, real=130, tie=False),
    }


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["audit", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_clean_model_exits_0(capsys: pytest.CaptureFixture[str], models: dict[str, Path]) -> None:
    code, out, err = run(capsys, str(models["clean"]))
    assert code == 0 and err == ""
    assert "real vocab 100 from tokenizer.json" in out
    assert "vocab audit: real=100 rows=128 aligned=128" in out
    assert "tied          yes (no lm_head weight in the checkpoint)" in out
    assert "aligned for tp1:ok  tp2:ok  tp4:NO  tp8:NO" in out
    assert "verdict: ok" in out


def test_violations_exit_1_with_the_fix(capsys: pytest.CaptureFixture[str],
                                        models: dict[str, Path]) -> None:
    code, out, _ = run(capsys, str(models["unaligned"]))
    assert code == 1 and "verdict: NOT OK" in out
    assert "fix: build embedding and lm_head with 128 rows" in out
    code, out, _ = run(capsys, str(models["untied"]))
    assert code == 1 and "real vocab 130 > head rows 128" in out and "weights untied" in out


def test_json(capsys: pytest.CaptureFixture[str], models: dict[str, Path]) -> None:
    code, out, _ = run(capsys, str(models["untied"]), "--json")
    data = json.loads(out)
    assert code == 1 and data["ok"] is False
    assert data["lm_head"] == {"name": "lm_head.weight", "shape": [128, 8],
                               "file": "model.safetensors"}
    assert data["audit"]["real"] == 130 and data["audit"]["tied"] is False
    assert data["audit"]["aligned_for_tp"] == {"1": True, "2": True, "4": False, "8": False}


def test_tensor_parallel_pad_multiple_and_vocab_size(capsys: pytest.CaptureFixture[str],
                                                     models: dict[str, Path]) -> None:
    clean = str(models["clean"])
    code, out, _ = run(capsys, clean, "--tensor-parallel", "4")
    assert code == 1 and "not a multiple of 256 (64 x tensor_parallel 4)" in out
    assert run(capsys, clean, "--tensor-parallel", "4", "--pad-multiple", "32")[0] == 0
    code, out, _ = run(capsys, clean, "--vocab-size", "129")
    assert code == 1 and "real vocab 129 from --vocab-size" in out
    code, _, err = run(capsys, clean, "--tensor-parallel", "0")
    assert code == 2 and "--tensor-parallel must be a positive integer, got 0" in err


def test_unreadable_input_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                  models: dict[str, Path]) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(models["clean"], broken)
    (broken / "model.safetensors").write_bytes(b"\xff" * 4)
    code, out, err = run(capsys, str(broken))
    assert code == 2 and out == ""
    assert err.startswith(f"guard audit: cannot read {broken / 'model.safetensors'}: 4 bytes; "
                          "expected a safetensors file")
    code, out, _ = run(capsys, str(broken), "--json")
    assert code == 2 and json.loads(out)["error"]["file"] == str(broken / "model.safetensors")
    (broken / "config.json").unlink()
    code, _, err = run(capsys, str(broken))
    assert code == 2 and "config.json: missing; expected the model's config.json" in err


def test_the_installed_command(models: dict[str, Path]) -> None:
    exe = Path(sys.executable).parent / "guard"  # this environment's, not one on PATH
    if not exe.exists():
        pytest.skip("the guard console script is not installed")
    done = subprocess.run([str(exe), "audit", str(models["unaligned"]), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and json.loads(done.stdout)["audit"]["rows"] == 100


def test_garbage_rows_exit_1_with_the_rows_in_json(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    d = write_model(tmp_path, 100, real=100, resize_to=128, padding=float("nan"))
    code, out, _ = run(capsys, str(d))
    assert code == 1 and "padding rows NOT OK" in out
    code, out, _ = run(capsys, str(d), "--json")
    data = json.loads(out)
    assert code == 1 and data["ok"] is False
    assert data["padding_rows"][0]["rows"] == [100, 128]
    assert data["padding_rows"][0]["nonfinite"] == 224


def test_audit_imports_no_torch(models: dict[str, Path]) -> None:
    code = ("import sys\nfrom guard.cli import main\n"
            f"status = main(['audit', {str(models['clean'])!r}])\n"
            "print(status, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[-2:] == ["0", "False"]


def test_output_closed_early_ends_quietly(models: dict[str, Path]) -> None:
    # `guard audit --json DIR | head` where head has gone: stdout is a pipe nobody reads.
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([sys.executable, "-m", "guard.cli", "audit", "--json",
                               str(models["untied"])], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=60)
    finally:
        os.close(write)
    assert done.returncode == SIGPIPE_STATUS == 141
    assert done.stderr == ""  # no BrokenPipeError traceback, no "Exception ignored" line
