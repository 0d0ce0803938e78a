"""The released wire versions on record (tests/data/wire/): each one's models, loaded from its
copy of guard_server/wire.py, and a report its guard sent; and today's report as a guard
sends it, with every field and check name added since the first release."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from guard_server.wire import Event, ReportBatch, UntrainedRows, UntrainedTokens
from tests.guard.sinks.helpers import one_report

RECORDED = Path(__file__).resolve().parent / "data" / "wire"
VERSIONS = sorted(int(p.name[1:]) for p in RECORDED.glob("v*") if p.is_dir())


def released_models(version: int) -> ModuleType:
    """That release's guard_server.wire, as a module of its own."""
    name = f"_released_wire_v{version}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, RECORDED / f"v{version}/wire.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # pydantic resolves the models' annotations through it
        spec.loader.exec_module(module)
    return sys.modules[name]


def recorded_report(version: int) -> bytes:
    return (RECORDED / f"v{version}/report.json").read_bytes()


def todays_report() -> ReportBatch:
    """A report of today's guard that uses what came after the first release: the untrained
    rows' fields, and the untrained_rows check's counts, event and halt (version 2); the
    gradients' fields, log Z and the updates the loop skipped (version 3)."""
    batch = one_report(run_id="today")
    event = Event(check="untrained_rows", action="fail", step=1, message="m", module=None)
    report = batch.reports[0].model_copy(update={
        "untrained_rows": UntrainedRows(embedding=3, lm_head=0),
        "untrained_tokens": UntrainedTokens(input=2, label=1),
        "violations": {"vocab": {"fail": 0}, "untrained_rows": {"fail": 1}},
        "halted": "untrained_rows", "events": [event],
        # version 3: the gradients, log Z, the updates the loop skipped
        "grad_norm": 0.8, "grad_norm_top": "wte.weight", "grad_norm_top_share": 0.4,
        "logsumexp": 10.9, "logsumexp_max": 11.3, "scaler_skipped_steps": 0,
        "nonfinite": batch.reports[0].nonfinite.model_copy(update={"grad": 0})})
    return batch.model_copy(update={"reports": [report]})
