"""The dashboards' tool fixtures (`run`: promtool, check-jsonschema, ...), for the deploy tests."""

from __future__ import annotations

from tests.dashboards.conftest import run

__all__ = ["run"]
