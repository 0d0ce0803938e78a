"""Settings come from GUARD_SERVER_* variables and every error names its variable."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from guard_server import ReportBatch, Settings, SettingsError
from guard_server.settings import _PARSED_PER_BODY
from guard_server.wire import MAX_EVENTS


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
        ({"GUARD_TOKEN": "two words"}, "GUARD_TOKEN", "character 4 of the token is a space"),
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
    # 8 bodies being read (1 MiB and a 128 KiB chunk each), 64 waiting (a chunk each), the
    # one being parsed (12 MiB with its parsed batch), 4 scrapes being written (128 bytes for
    # each of the 16,384 ranks the caps admit, and 5 MiB for a piece), and 2 reads answered
    # (a 2 MiB JSON page, twice, or a 1 MiB page of HTML rendered, 4x): 65 MiB of the 256.
    mib, chunk = 1 << 20, 128 << 10
    scrape = 16384 * 128 + 5 * mib
    assert Settings().scrape_bytes == scrape == 7 * mib
    assert Settings().read_bytes == 4 * mib
    assert Settings(max_page_bytes=2 * mib).read_bytes == 8 * mib
    bodies = 8 * (mib + chunk) + 64 * chunk + 12 * mib
    reads = 2 * 4 * mib
    assert Settings().inflight_bytes == bodies + 4 * scrape + reads == 65 * mib
    assert Settings().state_bytes == 191 * mib
    two = 2 * (mib + chunk) + 16 * chunk + 12 * mib
    assert Settings(max_inflight_bodies=2).state_bytes == 256 * mib - two - 4 * scrape - reads
    assert Settings(max_inflight_scrapes=1).state_bytes == 256 * mib - bodies - scrape - reads
    assert Settings(max_inflight_reads=1).state_bytes == 195 * mib
    with pytest.raises(SettingsError) as info:
        Settings(max_bytes=16 << 20)
    problem = info.value.problems["GUARD_SERVER_MAX_BYTES"]
    assert f"at least {66 * mib} bytes" in problem
    assert "GUARD_SERVER_MAX_INFLIGHT_BODIES=8" in problem
    assert "GUARD_SERVER_MAX_INFLIGHT_SCRAPES=4" in problem
    assert "GUARD_SERVER_MAX_INFLIGHT_READS=2" in problem


def test_the_reserve_covers_the_body_being_parsed(make_batch: Any, wire_example: Any) -> None:
    # The worst parse for a body's size: as many short events as 1 MiB holds, each a model.
    event = wire_example["reports"][0]["events"][0] | {"message": "", "module": None}
    limit = Settings().max_body_bytes
    one = len(json.dumps(make_batch(steps=(1,), events=[event] * MAX_EVENTS)))
    body = json.dumps(make_batch(steps=tuple(range(limit // one)), events=[event] * MAX_EVENTS))
    assert 0.95 * limit < len(body) <= limit
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        batch = ReportBatch.model_validate_json(body)
        parsed = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert len(batch.reports) * MAX_EVENTS > 9000
    assert len(body) + parsed <= _PARSED_PER_BODY * limit, parsed / len(body)


def test_the_series_figures_in_docs_server_md_are_the_codes() -> None:
    # The series a rank has and what the cap admits are counted from the families table;
    # docs/server.md states them, so a new family changes the doc or fails here.
    from guard_server.families import MAX_SERIES_PER_RANK, TYPICAL_SERIES_PER_RANK
    from guard_server.settings import MAX_RANKS, SPARE_SERIES

    doc = " ".join((Path(__file__).parents[2] / "docs/server.md").read_text().split())
    cap = Settings().max_series
    assert cap == MAX_RANKS * (TYPICAL_SERIES_PER_RANK + SPARE_SERIES)
    assert f"| `GUARD_SERVER_MAX_SERIES` | {cap} ({MAX_RANKS} x {cap // MAX_RANKS}) |" in doc
    assert (f"a typical rank (healthy, the default policy) has {TYPICAL_SERIES_PER_RANK}, the "
            f"costliest {MAX_SERIES_PER_RANK} (") in doc
    assert (f"`GUARD_SERVER_MAX_SERIES` ({cap:,}, {MAX_RANKS:,} x {cap // MAX_RANKS}) admits "
            f"every rank the other caps allow of the typical kind, with {SPARE_SERIES} series "
            f"to spare each, and {cap // MAX_SERIES_PER_RANK:,} of the costliest") in doc


def test_the_default_byte_budget_holds_every_typical_rank_the_rank_cap_allows(
        make_batch: Any) -> None:
    # A healthy rank of the default policy (every check reported at 0, its gradient's largest
    # parameter named), as many as GUARD_SERVER_MAX_RANKS allows, each run as full as
    # MAX_RANKS_PER_RUN: the series cap admits them (above), and so must the byte budget, or
    # part of the fleet docs/server.md sizes the caps for is refused with 429 over_budget.
    from guard_server.budget import report_bytes, run_bytes
    from guard_server.settings import MAX_RANKS
    from guard_server.wire import CHECKS, StepReport

    settings = Settings()
    report = StepReport.model_validate(make_batch(
        violations={check: {"warn": 0} for check in CHECKS},
        grad_norm=1.5, grad_norm_top="model.layers.31.mlp.down_proj.weight",
        grad_norm_top_share=0.2)["reports"][0])
    runs = -(-MAX_RANKS // settings.max_ranks_per_run)
    held = MAX_RANKS * report_bytes(report) + runs * run_bytes("r" * 64)
    assert held <= settings.state_bytes, (held, settings.state_bytes)


def test_every_setting_is_in_the_table_of_docs_server_md() -> None:
    # Each bound a setting, each setting documented with its default (issue 41): a new one
    # missing from the table fails here. The table writes a row's later names short
    # (`GUARD_SERVER_MAX_RUNS` / `_MAX_RANKS_PER_RUN`).
    from guard_server.settings import ENV_PREFIX

    doc = (Path(__file__).parents[2] / "docs/server.md").read_text()
    table = "\n".join(line for line in doc.splitlines() if line.startswith("| `"))
    for field in Settings.model_fields:
        name = (ENV_PREFIX + field).upper()
        short = "`_" + name.removeprefix(ENV_PREFIX) + "`"
        assert f"`{name}`" in table or short in table, name
