"""logitguard's metrics server: report ingest, Prometheus exposition, run state as JSON.

Names resolve on first use (PEP 562), so `import guard_server.wire`, which the library does,
pulls in pydantic only and never fastapi, uvicorn or prometheus_client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from guard_server.app import create_app
    from guard_server.embedded import EmbeddedServer
    from guard_server.errors import (
        AddressError,
        BodyTooLargeError,
        BusyError,
        CapacityError,
        PortInUseError,
        SettingsError,
        StepJumpError,
    )
    from guard_server.runner import serve
    from guard_server.settings import Settings
    from guard_server.store import Store
    from guard_server.wire import ReportBatch, StepReport

__all__ = [
    "AddressError",
    "BodyTooLargeError",
    "BusyError",
    "CapacityError",
    "EmbeddedServer",
    "PortInUseError",
    "ReportBatch",
    "Settings",
    "SettingsError",
    "StepJumpError",
    "StepReport",
    "Store",
    "create_app",
    "serve",
]

# Exported name -> the submodule that defines it.
_SOURCES = {
    "AddressError": "errors",
    "BodyTooLargeError": "errors",
    "BusyError": "errors",
    "CapacityError": "errors",
    "EmbeddedServer": "embedded",
    "PortInUseError": "errors",
    "ReportBatch": "wire",
    "Settings": "settings",
    "SettingsError": "errors",
    "StepJumpError": "errors",
    "StepReport": "wire",
    "Store": "store",
    "create_app": "app",
    "serve": "runner",
}


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{source}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
