"""deploy/kubernetes: every object validated against its schema, and the pieces fit together.

Core objects (Deployment, Service, ConfigMap, Job) against the Kubernetes API schemas that
kubernetes-validate ships, strictly (an unknown field is an error, as `kubectl apply`'s
server-side field validation makes it). The PodMonitors against prometheus-operator's CRD schema
(tests/data/prometheus-operator, vendored with its licence) with check-jsonschema, after closing
every object that lists its properties: the API server would prune a misspelt field of a
custom resource silently, and the scrape would quietly not happen. Then what no schema says:
the policy in the ConfigMap is one the guard accepts, the rank ports and the PodMonitor's
relabeling select the same endpoints, selectors select the pods they are meant for.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from guard.policy_file import load_policy
from tests.dashboards.conftest import Run
from tests.dashboards.queries import ROOT

KUBERNETES = ROOT / "deploy/kubernetes"
CRD = ROOT / "tests/data/prometheus-operator/monitoring.coreos.com_podmonitors.v1.openapi.json"
VERSION = "1.30.0"  # the oldest Kubernetes still supported by its maintainers in 2026
GUARD_PORT = 9464  # export.serve's port: local rank r serves on GUARD_PORT + r


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def by_kind() -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for doc in documents(path):
            found.setdefault(doc["kind"], []).append(doc)
    return found


CORE = [
    pytest.param(doc, id=f"{path.name}:{doc['kind']}")
    for path in sorted(KUBERNETES.glob("*.yaml"))
    for doc in documents(path)
    if doc["kind"] != "PodMonitor"
]
PODMONITORS = sorted(KUBERNETES.glob("podmonitor-*.yaml"))


def test_the_manifests_are_the_ones_the_docs_name() -> None:
    kinds = {k: len(v) for k, v in by_kind().items()}
    assert kinds == {"Deployment": 1, "Service": 2, "ConfigMap": 1, "Job": 1, "PodMonitor": 2}


@pytest.mark.parametrize("doc", CORE)
@pytest.mark.parametrize("version", [VERSION, kubernetes_validate.latest_version()])
def test_core_objects_validate_strictly(doc: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(doc, version, strict=True)


def test_strict_validation_rejects_a_misspelt_field() -> None:
    # The check above can fail: one wrong key in the Job's container is an error.
    job = copy.deepcopy(by_kind()["Job"][0])
    job["spec"]["template"]["spec"]["containers"][0]["port"] = [{"containerPort": 9464}]
    with pytest.raises(kubernetes_validate.ValidationError, match="port"):
        kubernetes_validate.validate(job, VERSION, strict=True)


def closed(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object that lists properties
    and says nothing else about extra ones."""
    if isinstance(schema, dict):
        out = {k: closed(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [closed(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def podmonitor_schema(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("schema") / "podmonitor.closed.json"
    path.write_text(json.dumps(closed(json.loads(CRD.read_text()))))
    return path


@pytest.mark.parametrize("path", PODMONITORS, ids=[p.name for p in PODMONITORS])
def test_podmonitors_validate_against_the_operator_crd(
    path: Path, podmonitor_schema: Path, run: Run
) -> None:
    run("check-jsonschema", "--schemafile", podmonitor_schema, path)


def test_the_crd_check_rejects_a_misspelt_field(
    tmp_path: Path, podmonitor_schema: Path, run: Run
) -> None:
    monitor = documents(KUBERNETES / "podmonitor-ranks.yaml")[0]
    monitor["spec"]["podMetricsEndpoints"][0]["scrapeInterval"] = "15s"  # it is `interval`
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(monitor))
    with pytest.raises(AssertionError, match="scrapeInterval"):
        run("check-jsonschema", "--schemafile", podmonitor_schema, bad)


def test_the_configmap_policy_is_one_the_guard_accepts() -> None:
    config = by_kind()["ConfigMap"][0]
    policy = load_policy(yaml.safe_load(config["data"]["guard.yaml"]))
    assert policy.export.serve == f"0.0.0.0:{GUARD_PORT}"  # reachable from Prometheus
    assert policy.export.push is None


def _trainer() -> dict[str, Any]:
    (job,) = by_kind()["Job"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return container


def _nproc_per_node() -> int:
    (flag,) = [a for a in _trainer()["command"] if a.startswith("--nproc-per-node=")]
    return int(flag.split("=", 1)[1])


def test_each_local_rank_has_its_guard_port_and_only_those_are_scraped() -> None:
    ports = {p["name"]: p["containerPort"] for p in _trainer()["ports"]}
    ranks = range(_nproc_per_node())
    assert {f"guard-{r}": GUARD_PORT + r for r in ranks}.items() <= ports.items()
    assert _trainer()["resources"]["limits"]["nvidia.com/gpu"] == len(ranks)
    (endpoint,) = documents(KUBERNETES / "podmonitor-ranks.yaml")[0]["spec"][
        "podMetricsEndpoints"]
    keep = endpoint["relabelings"][0]
    assert keep["action"] == "keep"
    assert keep["sourceLabels"] == ["__meta_kubernetes_pod_container_port_name"]
    # Prometheus anchors relabel regexes: the kept ports are exactly the guard ones.
    kept = {name for name in ports if re.fullmatch(keep["regex"], name)}
    assert kept == {f"guard-{r}" for r in ranks}


def test_selectors_select_their_pods() -> None:
    kinds = by_kind()
    (job,) = kinds["Job"]
    (deployment,) = kinds["Deployment"]
    job_labels = job["spec"]["template"]["metadata"]["labels"]
    server_labels = deployment["spec"]["template"]["metadata"]["labels"]
    monitors = {m["metadata"]["name"]: m["spec"]["selector"]["matchLabels"]
                for m in kinds["PodMonitor"]}
    assert monitors["guard-ranks"].items() <= job_labels.items()
    assert monitors["guard-server"].items() <= server_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= server_labels.items()
    services = {s["metadata"]["name"]: s["spec"] for s in kinds["Service"]}
    # An Indexed Job's pods carry job-name; the headless Service gives them DNS names.
    assert services["guarded-train"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert job["spec"]["template"]["spec"]["subdomain"] == "guarded-train"
    assert services["guard-server"]["selector"].items() <= server_labels.items()


def test_the_server_monitor_scrapes_the_port_the_server_listens_on() -> None:
    kinds = by_kind()
    (container,) = kinds["Deployment"][0]["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    (monitor,) = [m for m in kinds["PodMonitor"] if m["metadata"]["name"] == "guard-server"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert ports[endpoint["port"]] == 9400  # guard serve's default port
    # GuardServerDown watches up{job="guard-server"}: the job label comes from the pod label.
    assert kinds["Deployment"][0]["spec"]["template"]["metadata"]["labels"][
        monitor["spec"]["jobLabel"]] == "guard-server"
