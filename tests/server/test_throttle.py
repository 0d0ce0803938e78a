"""The one log throttle of the server and the push sink (guard_server/throttle.py), on an
injected clock: once per interval per kind, with the count of those not logged."""

from __future__ import annotations

import logging

import pytest

from guard_server.throttle import Throttle
from tests.server.conftest import FakeClock


def test_once_per_interval_per_kind_with_the_count_left_unlogged(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock(0.0)
    said = Throttle(logging.getLogger("throttle-test"), logging.WARNING, 60.0, clock)
    with caplog.at_level(logging.WARNING, logger="throttle-test"):
        for _ in range(5):
            said.say("a", "kind a %s")  # a message is logged as it is, never %-formatted
        said.say("b", "kind b")
        clock.advance(59.0)
        said.say("a", "kind a %s")
        clock.advance(1.0)
        said.say("a", "kind a again")
    assert [r.getMessage() for r in caplog.records] == [
        "kind a %s", "kind b", "kind a again (5 more like it since the last such line)"]
