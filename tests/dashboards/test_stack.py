"""The docker stack, checked statically (no Docker engine here): lint, schema, references."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.dashboards.conftest import Run
from tests.dashboards.queries import ROOT

DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
DOCKERFILES = sorted(p for p in DOCKER.glob("Dockerfile.*") if p.suffix != ".dockerignore")
SERVER_REQUIREMENTS = DOCKER / "requirements-server.txt"


def compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return doc


def service(name: str) -> dict[str, Any]:
    svc: dict[str, Any] = compose()["services"][name]
    return svc


def bind_mounts(name: str) -> list[tuple[Path, str]]:
    """(host path, container path) of each bind mount (short syntax) of a service."""
    mounts = []
    for volume in service(name).get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            mounts.append(((COMPOSE.parent / source).resolve(), target))
    return mounts


def host_path(name: str, container_path: str) -> Path:
    """Where a path inside a service's container comes from on the host."""
    for host, target in bind_mounts(name):
        if container_path == target or container_path.startswith(target.rstrip("/") + "/"):
            return host / os.path.relpath(container_path, target)
    raise AssertionError(f"{name}: nothing mounted at {container_path}")


def flag(name: str, option: str) -> str:
    """The value of `--option=value` in a service's command."""
    for arg in service(name)["command"]:
        if arg.startswith(option + "="):
            return str(arg.split("=", 1)[1])
    raise AssertionError(f"{name}: no {option} in its command")


def container_tree(name: str, root: Path) -> Path:
    """Copy a service's bind mounts to root/<container path>: the files as it sees them."""
    for host, target in bind_mounts(name):
        dest = root / target.lstrip("/")
        if host.is_dir():
            shutil.copytree(host, dest)
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(host, dest)
    return root


def instructions(dockerfile: Path) -> list[tuple[str, list[str]]]:
    """(INSTRUCTION, arguments): exec-form JSON or shell-split; continuations joined."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    found = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            rest = rest.strip()
            args = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
            found.append((word.upper(), args))
    return found


def dockerignore(dockerfile: Path, context: Path) -> list[str]:
    """Patterns BuildKit applies: <Dockerfile>.dockerignore beside it, else the context's."""
    for path in (
        dockerfile.with_name(dockerfile.name + ".dockerignore"),
        context / ".dockerignore",
    ):
        if path.is_file():
            lines = [line.strip() for line in path.read_text().splitlines()]
            return [line for line in lines if line and not line.startswith("#")]
    return []


def ignored(relpath: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parents wins."""
    parts = relpath.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.removeprefix("!").strip("/")
        if any(fnmatch.fnmatchcase(c, pattern) for c in candidates):
            result = not negate
    return result


def builds() -> list[tuple[str, Path, Path]]:
    """(service, context, Dockerfile) for each service built from this repository."""
    found = []
    for name, svc in compose()["services"].items():
        if "build" in svc:
            context = (COMPOSE.parent / svc["build"]["context"]).resolve()
            found.append((name, context, context / svc["build"]["dockerfile"]))
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_is_clean(run: Run, dockerfile: Path) -> None:
    assert run("hadolint", dockerfile).stdout == ""


def test_compose_file_matches_the_compose_spec(run: Run) -> None:
    # check-jsonschema vendors the compose-spec schema: no network needed.
    run("check-jsonschema", "--builtin-schema", "vendor.compose-spec", COMPOSE)


@pytest.mark.prometheus
def test_promtool_check_config_as_mounted(run: Run, tmp_path: Path) -> None:
    tree = container_tree("prometheus", tmp_path)
    config = tree / flag("prometheus", "--config.file").lstrip("/")
    out = run("promtool", "check", "config", config).stdout
    assert "SUCCESS: 1 rule files found" in out


@pytest.mark.prometheus
def test_amtool_check_config_as_mounted(run: Run, tmp_path: Path) -> None:
    tree = container_tree("alertmanager", tmp_path)
    run("amtool", "check-config", tree / flag("alertmanager", "--config.file").lstrip("/"))


def test_every_bind_mount_exists() -> None:
    for name in compose()["services"]:
        for host, target in bind_mounts(name):
            assert host.exists(), f"{name}: {host} (mounted at {target}) is missing"


def test_every_build_context_dockerfile_and_copy_source_exists() -> None:
    assert {p for _, _, p in builds()} == set(DOCKERFILES), "a Dockerfile is not in compose"
    for name, context, dockerfile in builds():
        assert dockerfile.is_file(), f"{name}: {dockerfile} is missing"
        patterns = dockerignore(dockerfile, context)
        assert ignored(".venv", patterns), f"{dockerfile.name}: the context would ship .venv"
        for word, args in instructions(dockerfile):
            if word not in {"COPY", "ADD"} or any(a.startswith("--from") for a in args):
                continue
            for source in [a for a in args if not a.startswith("--")][:-1]:
                path = context / source
                assert path.exists(), f"{dockerfile.name}: COPY {source} does not exist"
                files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
                for file in files:
                    rel = file.relative_to(context).as_posix()
                    if "__pycache__" in rel or ".egg-info" in rel:
                        continue
                    assert not ignored(rel, patterns), f"{dockerfile.name}: {rel} is .dockerignored"


def test_prometheus_config_and_rules_are_mounted() -> None:
    config_path = host_path("prometheus", flag("prometheus", "--config.file"))
    config = yaml.safe_load(config_path.read_text())
    for rule_file in config["rule_files"]:
        assert (config_path.parent / rule_file).is_file(), f"rule file {rule_file} is missing"
    assert host_path("alertmanager", flag("alertmanager", "--config.file")).is_file()


def test_grafana_provisioning_is_mounted() -> None:
    for kind in ("datasources", "dashboards", "alerting"):
        assert host_path("grafana", f"/etc/grafana/provisioning/{kind}").is_dir()
    provider_dir = host_path("grafana", "/etc/grafana/provisioning/dashboards")
    for provider_file in provider_dir.glob("*.yaml"):
        for provider in yaml.safe_load(provider_file.read_text())["providers"]:
            folder = host_path("grafana", provider["options"]["path"])
            assert list(folder.glob("*.json")), f"no dashboard JSON in {folder}"
    home = service("grafana")["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert host_path("grafana", home).is_file()


def test_addresses_name_compose_services() -> None:
    services = compose()["services"]
    prom = yaml.safe_load(host_path("prometheus", flag("prometheus", "--config.file")).read_text())
    addresses = [
        t
        for section in (prom["scrape_configs"], prom["alerting"]["alertmanagers"])
        for entry in section
        for static in entry["static_configs"]
        for t in static["targets"]
    ]
    datasource_dir = host_path("grafana", "/etc/grafana/provisioning/datasources")
    for ds_file in datasource_dir.glob("*.yaml"):
        for ds in yaml.safe_load(ds_file.read_text())["datasources"]:
            addresses.append(ds["url"].removeprefix("http://"))
    trainer = dict(instructions(DOCKER / "Dockerfile.trainer"))["CMD"]
    addresses.append(trainer[trainer.index("--push") + 1].removeprefix("http://"))
    (server_port,) = dict(instructions(DOCKER / "Dockerfile.server"))["EXPOSE"]
    for address in addresses:
        host, _, port = address.partition(":")
        assert host in services, f"{address}: no compose service {host!r}"
        if host == "guard-server":
            assert port == server_port, f"{address}: guard-server listens on {server_port}"


def test_images_are_pinned() -> None:
    images = [svc["image"] for svc in compose()["services"].values() if "build" not in svc]
    images += [args[0] for p in DOCKERFILES for word, args in instructions(p) if word == "FROM"]
    for image in images:
        tag = image.partition(":")[2]
        assert tag and tag != "latest" and re.search(r"\d+\.\d+", tag), f"{image} is not pinned"


def test_server_image_installs_the_server_and_no_torch(tmp_path: Path) -> None:
    # Import the server with only what requirements-server.txt brings (and what those
    # packages require in turn); any other third-party import fails as in the image.
    script = textwrap.dedent(
        """
        import importlib.metadata as md, site, sys, sysconfig
        from importlib.machinery import PathFinder
        from packaging.requirements import Requirement
        from packaging.utils import canonicalize_name as canon

        def closure(reqs):
            seen, todo = set(), [Requirement(r) for r in reqs]
            while todo:
                req = todo.pop()
                if req.marker and not req.marker.evaluate({"extra": ""}):
                    continue
                if canon(req.name) not in seen:
                    seen.add(canon(req.name))
                    todo += [Requirement(r) for r in md.requires(req.name) or []]
            return seen

        dists = closure(sys.argv[1:])
        assert not dists & {"torch", "logitguard"}, dists
        allowed = {"guard_server"} | {
            top for top, owners in md.packages_distributions().items()
            if any(canon(owner) in dists for owner in owners)
        }
        stdlib = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")})
        site_dirs = tuple(site.getsitepackages())  # inside platstdlib in a venv

        def in_stdlib(top):
            if top in sys.stdlib_module_names:
                return True
            spec = PathFinder.find_spec(top)
            origin = spec.origin if spec and spec.origin else ""
            return origin.startswith(stdlib) and not origin.startswith(site_dirs)

        class ImageOnly:
            def find_spec(self, name, path=None, target=None):
                top = name.partition(".")[0]
                if top not in allowed and not in_stdlib(top):
                    raise ModuleNotFoundError(f"{top} is not in the guard-server image")

        sys.meta_path.insert(0, ImageOnly())
        import guard_server.__main__
        from guard_server import Settings, create_app
        create_app(Settings())
        assert "torch" not in sys.modules and "guard" not in sys.modules
        """
    )
    requirements = [
        line.strip()
        for line in SERVER_REQUIREMENTS.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT / "server")}
    result = subprocess.run(
        [sys.executable, "-c", script, *requirements],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    server_dockerfile = dict(instructions(DOCKER / "Dockerfile.server"))
    assert server_dockerfile["CMD"] == [
        *("python", "-m", "guard_server", "--host", "0.0.0.0", "--port", "9400")
    ]
