"""What a running Prometheus says about the dashboard's variables and the loaded alert rules."""

from __future__ import annotations

from guard_server.testing import Prometheus
from tests.dashboards.queries import variable_queries


def offered_variables(prom: Prometheus, run_id: str) -> dict[str, set[str]]:
    """Per dashboard variable, the values its label_values query offers."""
    offered = {}
    for var in variable_queries(run_id=run_id):
        reply = prom.client.get(f"{prom.url}/api/v1/label/{var.label}/values",
                                params={"match[]": var.selector})
        reply.raise_for_status()
        offered[var.name] = set(reply.json()["data"])
    return offered


def loaded_alerts(prom: Prometheus) -> set[str]:
    """Names of the rules Prometheus loaded."""
    reply = prom.client.get(f"{prom.url}/api/v1/rules")
    reply.raise_for_status()
    return {r["name"] for g in reply.json()["data"]["groups"] for r in g["rules"]}
