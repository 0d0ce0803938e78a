"""Fuzz the app from its own OpenAPI schema: no 5xx, and every answer matches the schema."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings

from guard_server import Settings, create_app

# Caps far above what ~100 examples can reach, so a valid batch is never a 429.
APP = create_app(Settings(max_runs=100_000, max_ranks_per_run=100_000))
SCHEMA = schemathesis.openapi.from_asgi("/openapi.json", APP)


@SCHEMA.include(path="/v1/reports", method="POST").parametrize()
@settings(
    max_examples=100, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
def test_ingest_never_fails_on_its_own_schema(case: schemathesis.Case) -> None:
    case.call_and_validate()


@SCHEMA.include(method="GET").parametrize()
@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_reads_match_their_schema(case: schemathesis.Case) -> None:
    case.call_and_validate()
