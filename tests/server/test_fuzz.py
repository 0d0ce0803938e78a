"""Fuzz the app from its own OpenAPI schema: no 5xx, and every answer matches the schema."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.config import SchemathesisConfig

from guard_server import Settings, create_app

# Caps far above what ~100 examples can reach, so a valid batch is never a 429; and the bounds
# on fields the server does not know (which the schema leaves open: a newer guard's), so one
# is never a 422.
APP = create_app(Settings(max_runs=100_000, max_ranks_per_run=100_000,
                          max_unknown_fields=100_000, max_unknown_bytes=1 << 30))
# A body over the byte limit is refused (413) before it is parsed, so an invalid batch of
# more than 1000 reports may be too large before it is invalid; schemathesis's default list
# of rejections lacks 413. Which examples it draws shifts with any constant in the code.
REJECTED = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429"]
CONFIG = SchemathesisConfig.from_dict(
    {"checks": {"negative_data_rejection": {"expected-statuses": REJECTED}}}
)
SCHEMA = schemathesis.openapi.from_asgi("/openapi.json", APP, config=CONFIG)


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
