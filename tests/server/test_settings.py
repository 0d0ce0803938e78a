"""Settings come from GUARD_SERVER_* variables and every error names its variable."""

from __future__ import annotations

from pathlib import Path

import pytest

from guard_server import Settings, SettingsError


def test_defaults() -> None:
    s = Settings()
    assert (s.host, s.port, s.max_body_bytes) == ("127.0.0.1", 9400, 1 << 20)
    assert (s.rank_ttl_s, s.finished_ttl_s, s.token) == (900.0, 300.0, None)


def test_environment_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GUARD_SERVER_PORT", "9500")
    monkeypatch.setenv("GUARD_SERVER_MAX_RUNS", "3")
    monkeypatch.setenv("GUARD_SERVER_RANK_TTL_S", "60")
    s = Settings()
    assert (s.port, s.max_runs, s.rank_ttl_s) == (9500, 3, 60.0)


@pytest.mark.parametrize("var", ["GUARD_TOKEN", "GUARD_SERVER_TOKEN"])
def test_token_from_either_variable(monkeypatch: pytest.MonkeyPatch, var: str) -> None:
    monkeypatch.setenv(var, "s3cret")
    token = Settings().token
    assert token is not None and token.get_secret_value() == "s3cret"
    assert "s3cret" not in repr(Settings())


def test_token_from_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("from-file\n")
    monkeypatch.setenv("GUARD_SERVER_TOKEN_FILE", str(path))
    token = Settings().token
    assert token is not None and token.get_secret_value() == "from-file"


@pytest.mark.parametrize(
    ("env", "named", "says"),
    [
        ({"GUARD_SERVER_PORT": "abc"}, "GUARD_SERVER_PORT", "'abc'"),
        ({"GUARD_SERVER_PORT": "70000"}, "GUARD_SERVER_PORT", "less than or equal to 65535"),
        ({"GUARD_SERVER_MAX_BODY_BYTES": "10"}, "GUARD_SERVER_MAX_BODY_BYTES", "1024"),
        ({"GUARD_SERVER_RANK_TTL_S": "inf"}, "GUARD_SERVER_RANK_TTL_S", "finite"),
        ({"GUARD_SERVER_PROT": "1"}, "GUARD_SERVER_PROT", "unknown setting"),
        ({"GUARD_TOKEN": " "}, "GUARD_TOKEN", "empty"),
        (
            {"GUARD_SERVER_TOKEN_FILE": "/nonexistent/token"},
            "GUARD_SERVER_TOKEN_FILE",
            "cannot read",
        ),
        (
            {"GUARD_TOKEN": "a", "GUARD_SERVER_TOKEN_FILE": "/x"},
            "GUARD_SERVER_TOKEN_FILE",
            "not both",
        ),
    ],
)
def test_errors_name_the_variable(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], named: str, says: str
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SettingsError) as info:
        Settings()
    assert named in str(info.value) and says in str(info.value)
    assert isinstance(info.value, ValueError)


def test_a_bad_token_is_never_echoed(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SettingsError) as info:
        Settings(token="   ", port="x")
    assert "GUARD_SERVER_PORT" in str(info.value) and "'   '" not in str(info.value)


def test_the_byte_budget_keeps_room_for_requests_in_flight() -> None:
    assert Settings().state_bytes == (256 << 20) - 4 * (1 << 20)
    with pytest.raises(SettingsError) as info:
        Settings(max_bytes=4 << 20)
    assert "at least 5242880 bytes" in info.value.problems["GUARD_SERVER_MAX_BYTES"]

