"""logitguard's metrics server: report ingest, Prometheus exposition, run state as JSON."""

from __future__ import annotations

from guard_server.app import create_app
from guard_server.embedded import EmbeddedServer
from guard_server.errors import BodyTooLargeError, CapacityError, PortInUseError, SettingsError
from guard_server.runner import serve
from guard_server.schema import ReportBatch, StepReport
from guard_server.settings import Settings
from guard_server.store import Store

__all__ = [
    "BodyTooLargeError",
    "CapacityError",
    "EmbeddedServer",
    "PortInUseError",
    "ReportBatch",
    "Settings",
    "SettingsError",
    "StepReport",
    "Store",
    "create_app",
    "serve",
]
