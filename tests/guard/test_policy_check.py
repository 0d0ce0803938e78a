"""`guard policy check`: one line per problem with attach's messages, status 0/1."""

from __future__ import annotations

from pathlib import Path

import pytest

from guard import cli
from guard.errors import PolicyError
from guard.policy_file import load_policy


def test_valid_file_is_ok(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("{}\n")
    assert cli.main(["policy", "check", str(good)]) == 0
    assert capsys.readouterr().out == f"{good}: ok\n"


def test_bad_file_same_messages_as_load(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.json"
    good.write_text("{}")
    bad = tmp_path / "bad.yaml"
    bad.write_text("no_such_key: 1\nother_unknown: 2\n")
    with pytest.raises(PolicyError) as info:
        load_policy(bad)
    assert len(info.value.problems) >= 1
    assert cli.main(["policy", "check", str(good), str(bad)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{good}: ok"
    assert lines[1:] == [f"{info.value.source}: {p}" for p in info.value.problems]


def test_missing_file_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "absent.toml"
    assert cli.main(["policy", "check", str(missing)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(str(missing)) and "ok" not in out.split(":", 1)[1]
