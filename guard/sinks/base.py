"""The `Sink` protocol, and the sinks a policy's `export` section asks for."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from guard.errors import AttachError
from guard_server.wire import ReportBatch

if TYPE_CHECKING:
    from guard.policy import Export

__all__ = ["Sink", "open_sinks"]


class Sink(Protocol):
    """Receives one report per read boundary, as a one-report batch that says which run and
    rank sent it; must never block or raise into training."""

    def emit(self, batch: ReportBatch) -> None: ...

    def close(self, timeout: float = 5.0) -> None: ...


def open_sinks(export: Export, local_rank: int) -> list[Sink]:
    """The embedded endpoint (port + local rank) and the push sink, as `export` says; an
    endpoint that cannot start is a warning, and training goes on without it."""
    from guard.sinks.embedded import start_embedded
    from guard.sinks.push import PushSink
    from guard.sinks.quiet import quiet_dependencies

    sinks: list[Sink] = []
    address = export.serve_address(local_rank)
    if address is not None and (embedded := start_embedded(*address)) is not None:
        sinks.append(embedded)
    if export.push is not None:
        try:
            sinks.append(PushSink(export.push))
            quiet_dependencies()
        except ValueError as e:  # GUARD_TOKEN is no bearer token: said at start, not at step 1
            for sink in sinks:
                sink.close()
            raise AttachError(f"guard: export.push: {e}") from None
    return sinks
