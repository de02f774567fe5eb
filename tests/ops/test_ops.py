"""The operations files hold together: ops/deploy (Kubernetes manifests, systemd units),
ops/alerts (Prometheus rules and their unit tests) and ops/dashboards (Grafana).

- Every manifest validates offline against the Kubernetes 1.30 schemas (kubernetes-validate,
  strict: an unknown or misspelt field fails), and has the properties the issue asks for:
  probes on /healthz and /readyz, a non-root user, a read-only root filesystem, requests and
  limits, the socket's emptyDir in the engine, the sidecar and the workers, URLs and tokens from
  Secrets in the shared-log variant and the fleet service; every kvledger command line and
  KVLEDGER_* variable in them is one the CLI knows.
- The systemd units pass `systemd-analyze verify` (when it is installed) and are hardened.
- The rules pass `promtool check rules` and `promtool test rules`; every dashboard expression
  parses (run through promtool as a recording rule).
- Every metric name the rules and the dashboard use is served by a live sidecar's /metrics or
  the fleet service's registry, so renaming a metric fails here until they follow.

promtool comes from Debian's `prometheus` package, unpacked by ops/tools/install-promtool.sh
into .tools/prometheus (or found on PATH). Without it those tests skip with the reason;
KVLEDGER_REQUIRE_PROMTOOL=1 (CI) makes that a failure.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import subprocess
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import typer
import yaml  # type: ignore[import-untyped]
from prometheus_client import generate_latest

from coordinator.audit.fleet_http import FleetHealth
from coordinator.cli.main import app
from events.log import open_log
from tests.conftest import unavailable
from tests.kit.sidecar import sidecar_on

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "ops" / "deploy"
RULES = ROOT / "ops" / "alerts" / "kvledger.rules.yml"
RULE_TESTS = ROOT / "ops" / "alerts" / "kvledger.rules.test.yml"
DASHBOARD = ROOT / "ops" / "dashboards" / "kvledger.json"
KUBERNETES_VERSION = "1.30.0"
REQUIRE_PROMTOOL = os.environ.get("KVLEDGER_REQUIRE_PROMTOOL") == "1"
SOCKET_VOLUME = "kvledger-run"
SIDECAR_PORT, FLEET_PORT = 9464, 9470

Manifest = dict[str, Any]


# --- the manifests ---------------------------------------------------------------------------------


def manifests() -> list[tuple[str, Manifest]]:
    found = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document is not None:
                found.append((f"{path.name}:{document['kind']}/{document['metadata']['name']}", document))
    return found


def workloads() -> list[tuple[str, Manifest]]:
    return [(name, doc) for name, doc in manifests() if doc["kind"] in ("Deployment", "StatefulSet", "Pod")]


def pod_spec(workload: Manifest) -> Manifest:
    spec: Manifest = workload["spec"] if workload["kind"] == "Pod" else workload["spec"]["template"]["spec"]
    return spec


def containers(spec: Manifest) -> list[Manifest]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def kvledger_command(container: Manifest) -> list[str] | None:
    """The container's kvledger command line (command + args), or None for another program."""
    line: list[str] = [*container.get("command", []), *container.get("args", [])]
    return line if line[:1] == ["kvledger"] else None


def by_command(spec: Manifest, *words: str) -> list[Manifest]:
    return [c for c in containers(spec) if (kvledger_command(c) or [])[1 : 1 + len(words)] == list(words)]


def engines(spec: Manifest) -> list[Manifest]:
    return [c for c in spec["containers"] if kvledger_command(c) is None]


def env(container: Manifest) -> dict[str, Manifest]:
    return {item["name"]: item for item in container.get("env", [])}


def test_there_are_manifests_for_the_pod_the_shared_log_variant_and_the_fleet_service() -> None:
    names = {path.name for path in DEPLOY.glob("*.yaml")}
    assert {"inference-sqlite.yaml", "inference-shared-log.yaml", "fleet.yaml", "secrets.example.yaml"} <= names
    assert len(workloads()) == 3


@pytest.mark.parametrize(("name", "document"), manifests(), ids=[name for name, _ in manifests()])
def test_every_manifest_validates_against_the_kubernetes_schemas_strictly(name: str, document: Manifest) -> None:
    try:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        pytest.fail(f"{name}: {'.'.join(str(p) for p in error.path)}: {error.message}")


def test_strict_validation_catches_a_misspelt_field() -> None:
    """The check above is not vacuous: an unknown field in a container fails it."""
    _, workload = workloads()[0]
    broken = json.loads(json.dumps(workload))
    pod_spec(broken)["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize(("name", "workload"), workloads(), ids=[name for name, _ in workloads()])
def test_every_pod_runs_as_non_root_with_a_read_only_root_and_resources(name: str, workload: Manifest) -> None:
    spec = pod_spec(workload)
    pod_security = spec["securityContext"]
    assert pod_security["runAsNonRoot"] is True and pod_security["runAsUser"] > 0, name
    assert spec.get("automountServiceAccountToken") is False, name
    for container in containers(spec):
        where = f"{name} container {container['name']}"
        security = container["securityContext"]
        assert security["readOnlyRootFilesystem"] is True, where
        assert security["allowPrivilegeEscalation"] is False, where
        assert security["capabilities"]["drop"] == ["ALL"], where
        assert security.get("runAsUser", pod_security["runAsUser"]) > 0, where
        for bound in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(container["resources"][bound]), f"{where}: {bound}"


@pytest.mark.parametrize(("name", "workload"), workloads(), ids=[name for name, _ in workloads()])
def test_kvledger_services_are_probed_on_healthz_and_readyz_at_their_http_port(name: str, workload: Manifest) -> None:
    spec = pod_spec(workload)
    services = [*by_command(spec, "serve"), *by_command(spec, "fleet")]
    assert len(services) == 1, name
    [service] = services
    command = kvledger_command(service)
    assert command is not None
    http = option_value(command, "--http")
    assert http is not None and http.startswith("0.0.0.0:"), "the kubelet probes the pod IP, not loopback"
    assert "--allow-remote" in command, "a non-loopback --http needs --allow-remote"
    port = int(http.rsplit(":", 1)[1])
    assert port == (SIDECAR_PORT if command[1] == "serve" else FLEET_PORT)
    ports = {p["name"]: p["containerPort"] for p in service["ports"]}

    def probed(probe: str) -> tuple[str, int]:
        get = service[probe]["httpGet"]
        return get["path"], ports.get(get["port"], get["port"])

    assert probed("livenessProbe") == ("/healthz", port)
    assert probed("readinessProbe") == ("/readyz", port)
    assert probed("startupProbe") == ("/healthz", port), "recovery replays the log before anything listens"
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port)


@pytest.mark.parametrize("manifest", ["inference-sqlite.yaml", "inference-shared-log.yaml"])
def test_the_socket_is_an_empty_dir_shared_by_the_engine_the_sidecar_and_every_worker(manifest: str) -> None:
    [(_, workload)] = [(n, w) for n, w in workloads() if n.startswith(manifest)]
    spec = pod_spec(workload)
    volume = next(v for v in spec["volumes"] if v["name"] == SOCKET_VOLUME)
    assert "emptyDir" in volume
    [sidecar] = by_command(spec, "serve")
    workers = by_command(spec, "worker")
    assert len(workers) == 2, "one worker per tensor-parallel rank"
    assert sorted(option_value(kvledger_command(w) or [], "--rank") or "" for w in workers) == ["0", "1"]
    [engine] = engines(spec)
    serve_line = kvledger_command(sidecar) or []
    socket = option_value(serve_line, "--socket")
    assert socket is not None
    for container in (sidecar, *workers, engine):
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts.get(SOCKET_VOLUME) == str(Path(socket).parent), container["name"]
    for worker in workers:
        assert option_value(kvledger_command(worker) or [], "--socket") == socket
    assert env(engine)["KVLEDGER_SOCKET"]["value"] == socket
    # The engine id is the pod's name, for the engine and its workers alike.
    for container in (*workers, engine):
        assert env(container)["KVLEDGER_ENGINE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # The sidecar is a native sidecar (up before the engine, down after it), as are the workers.
    for container in (sidecar, *workers):
        assert container in spec["initContainers"] and container["restartPolicy"] == "Always"


@pytest.mark.parametrize(("name", "workload"), workloads(), ids=[name for name, _ in workloads()])
def test_every_path_kvledger_writes_is_a_volume(name: str, workload: Manifest) -> None:
    """With a read-only root, the data directory, the worker's state, the socket's directory and
    HOME (Python's and torch's caches) must each be on a mounted volume."""
    spec = pod_spec(workload)
    for container in containers(spec):
        command = kvledger_command(container)
        if command is None:
            continue
        mounts = [m["mountPath"] for m in container.get("volumeMounts", []) if not m.get("readOnly")]
        variables = env(container)
        paths = [variables[v]["value"] for v in ("KVLEDGER_DATA_DIR", "KVLEDGER_WORKER_STATE", "HOME") if v in variables]
        paths += [p for p in (option_value(command, o) for o in ("--socket", "--log", "--state-dir")) if p and p.startswith("/")]
        assert "KVLEDGER_DATA_DIR" in variables or command[1] == "db", f"{name} {container['name']}"
        for path in paths:
            assert any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts), f"{name} {container['name']}: {path}"


def test_the_shared_log_variant_and_the_fleet_take_every_url_and_token_from_secrets() -> None:
    secrets = {doc["metadata"]["name"]: doc for _, doc in manifests() if doc["kind"] == "Secret"}
    for name, workload in workloads():
        if name.startswith("inference-sqlite"):
            continue
        spec = pod_spec(workload)
        text = yaml.safe_dump(spec)
        assert "postgresql://" not in text and "kafka://" not in text, f"{name}: a URL outside a Secret"
        for container in containers(spec):
            command = kvledger_command(container) or []
            assert option_value(command, "--log") is None and option_value(command, "--token") is None
            variables = env(container)
            for variable in ("KVLEDGER_LOG", "KVLEDGER_TOKEN", "KVLEDGER_FLEET_DB"):
                if variable in variables:
                    ref = variables[variable]["valueFrom"]["secretKeyRef"]
                    assert ref["key"] in secrets[ref["name"]]["stringData"], f"{name}: {variable}"
            if "KVLEDGER_AUDIT_TOKENS" in variables:  # a file from a Secret volume
                path = Path(variables["KVLEDGER_AUDIT_TOKENS"]["value"])
                mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(path.parent))
                volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
                assert path.name in secrets[volume["secret"]["secretName"]]["stringData"]
        [service] = [*by_command(spec, "serve"), *by_command(spec, "fleet")]
        variables = env(service)
        assert "secretKeyRef" in variables["KVLEDGER_LOG"]["valueFrom"] and "KVLEDGER_AUDIT_TOKENS" in variables
        if kvledger_command(service)[1] == "serve":  # type: ignore[index]
            assert "secretKeyRef" in variables["KVLEDGER_TOKEN"]["valueFrom"]
            assert by_command(spec, "db", "upgrade"), "the log's schema is brought to head before serving"
        else:
            assert "secretKeyRef" in variables["KVLEDGER_FLEET_DB"]["valueFrom"]


# --- the manifests speak the CLI as it is ------------------------------------------------------------


def cli_command(words: list[str]) -> Any:
    """The click command (typer's vendored click) for `kvledger WORDS...`."""
    command: Any = typer.main.get_command(app)
    for word in words:
        assert hasattr(command, "commands"), words
        command = command.commands[word]
    return command


def cli_envvars() -> set[str]:
    found: set[str] = set()

    def walk(command: Any) -> None:
        for param in command.params:
            envvar = getattr(param, "envvar", None)
            found.update([envvar] if isinstance(envvar, str) else envvar or [])
        if hasattr(command, "commands"):
            for sub in command.commands.values():
                walk(sub)

    walk(typer.main.get_command(app))
    return found


def option_value(command: list[str], option: str) -> str | None:
    for index, word in enumerate(command):
        if word.startswith(option + "="):
            return word.split("=", 1)[1]
        if word == option and index + 1 < len(command):
            return command[index + 1]
    return None


def test_every_kvledger_command_line_and_variable_in_the_manifests_is_one_the_cli_knows() -> None:
    known_variables = cli_envvars() | {"KVLEDGER_DATA_DIR", "KVLEDGER_LOG_LEVEL"}
    seen = 0
    for name, workload in workloads():
        for container in containers(pod_spec(workload)):
            for variable in env(container):
                if variable.startswith("KVLEDGER_"):
                    assert variable in known_variables, f"{name} {container['name']}: {variable}"
            line = kvledger_command(container)
            if line is None:
                continue
            words = [w for w in line[1:] if not w.startswith("-")]
            words = words[:2] if words[:1] == ["db"] else words[:1]
            command = cli_command(words)
            options = {opt for param in command.params for opt in param.opts}
            for word in line[1 + len(words) :]:
                if word.startswith("--"):
                    assert word.split("=", 1)[0] in options, f"{name} {container['name']}: {word}"
            seen += 1
    assert seen >= 8


# --- systemd ------------------------------------------------------------------------------------------


def unit(path: Path) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(path.read_text())
    return parser


@pytest.mark.parametrize("name", ["kvledger.service", "kvledger-worker@.service"])
def test_the_systemd_units_are_hardened(name: str) -> None:
    service = unit(DEPLOY / name)["Service"]
    assert service["User"] == "kvledger" and service["Group"] == "kvledger", "one user: the socket is mode 0600"
    for key, value in {
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "NoNewPrivileges": "yes",
        "PrivateTmp": "yes",
        "CapabilityBoundingSet": "",
        "RestrictSUIDSGID": "yes",
        "UMask": "0077",
        "SystemCallArchitectures": "native",
    }.items():
        assert service[key] == value, f"{name}: {key}"
    assert "StateDirectory" in service and "Restart" in service
    assert service["ExecStart"].startswith("/opt/kvledger/.venv/bin/kvledger ")
    line = service["ExecStart"].split()[1:]
    command = cli_command(line[:1])
    options = {opt for param in command.params for opt in param.opts}
    assert all(word in options for word in line if word.startswith("--")), line
    variables = {entry.split("=", 1)[0] for key, entry in service.items() if key == "Environment"}
    assert variables <= cli_envvars() | {"KVLEDGER_DATA_DIR", "KVLEDGER_TIERS", "HOME"}


def test_the_sidecar_unit_keeps_its_socket_and_log_where_systemd_gives_it_directories() -> None:
    service = unit(DEPLOY / "kvledger.service")["Service"]
    text = (DEPLOY / "kvledger.service").read_text()
    assert "Environment=KVLEDGER_SOCKET=/run/kvledger/kvledger.sock" in text and service["RuntimeDirectory"] == "kvledger"
    assert "Environment=KVLEDGER_DATA_DIR=/var/lib/kvledger" in text and service["StateDirectory"] == "kvledger"
    assert service["KillSignal"] == "SIGTERM", "SIGTERM drains, commits and snapshots"


def test_systemd_analyze_verify_finds_nothing_in_the_units(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed: the units were only parsed (test_the_systemd_units_are_hardened)")
    # verify insists that ExecStart's program exists: point it at this checkout's kvledger.
    for path in DEPLOY.glob("*.service"):
        (tmp_path / path.name).write_text(
            path.read_text().replace("/opt/kvledger/.venv/bin/kvledger", str(ROOT / ".venv/bin/kvledger"))
        )
    result = subprocess.run(
        [analyze, "verify", "--man=no", str(tmp_path / "kvledger.service"), str(tmp_path / "kvledger-worker@0.service")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and not result.stderr.strip() and not result.stdout.strip(), result.stderr + result.stdout


# --- promtool -----------------------------------------------------------------------------------------


def promtool() -> str:
    candidates = [ROOT / ".tools" / "prometheus" / "usr" / "bin" / "promtool", shutil.which("promtool")]
    for candidate in candidates:
        if candidate is not None and os.access(candidate, os.X_OK):
            return str(candidate)
    unavailable(
        "promtool not found in .tools/prometheus or on PATH (install it: sh ops/tools/install-promtool.sh)",
        REQUIRE_PROMTOOL,
        "KVLEDGER_REQUIRE_PROMTOOL",
    )


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120)


def test_promtool_checks_the_rules() -> None:
    result = run_promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_the_alerts() -> None:
    """ops/alerts/kvledger.rules.test.yml: readiness false fires after its `for:` and not
    before, an integrity violation fires at once, a stuck pin, a refusal spike against its own
    last hour (and not a steady reason), step p99 above 5 ms, the fleet unready."""
    result = run_promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_check_fails_a_broken_rule(tmp_path: Path) -> None:
    """The two checks above can fail."""
    broken = tmp_path / "broken.yml"
    broken.write_text(
        RULES.read_text().replace(
            "increase(kvledger_integrity_violations_total[5m]) > 0", "increase(kvledger_integrity_violations_total[5m] > 0"
        )
    )
    assert run_promtool("check", "rules", str(broken)).returncode != 0


def test_every_dashboard_expression_parses(tmp_path: Path) -> None:
    """Grafana's variables replaced by values, each expression becomes a recording rule, and
    promtool parses the lot."""
    rules = [
        {"record": f"kvledger_dashboard:expr_{index}", "expr": grafana_free(expr)}
        for index, expr in enumerate(dashboard_expressions())
    ]
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = run_promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


# --- metric names -------------------------------------------------------------------------------------


def grafana_free(expr: str) -> str:
    return (
        expr.replace("$__rate_interval", "5m").replace("$__range", "1h").replace("$__interval", "1m").replace("$instance", ".*")
    )


def walk_panels(panels: list[Manifest]) -> Iterator[Manifest]:
    for panel in panels:
        yield panel
        yield from walk_panels(panel.get("panels", []))


def dashboard_expressions() -> list[str]:
    model = json.loads(DASHBOARD.read_text())
    found = [target["expr"] for panel in walk_panels(model["panels"]) for target in panel.get("targets", [])]
    for variable in model["templating"]["list"]:
        if variable["type"] == "query":
            found.append(re.sub(r"label_values\((\w+),\s*\w+\)", r"\1", variable["definition"]))
    return found


def rule_documents() -> list[Manifest]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


METRIC = re.compile(r"\bkvledger[_:][A-Za-z0-9_:]*")


def names_in(expressions: list[str]) -> set[str]:
    return {name for expr in expressions for name in METRIC.findall(expr)}


async def exported_names() -> set[str]:
    """Every series name a live sidecar serves on /metrics (a histogram's _bucket, _count and
    _sum; a labelled family with no child yet counts by its TYPE line), and the fleet service's."""
    names: set[str] = set()

    def scan(text: str) -> None:
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split()
                names.update([name, f"{name}_bucket", f"{name}_count", f"{name}_sum"] if kind == "histogram" else [name])
            elif line and not line.startswith("#"):
                names.add(re.split(r"[{ ]", line, maxsplit=1)[0])

    with tempfile.TemporaryDirectory() as scratch:
        event_log = await open_log(str(Path(scratch) / "log.sqlite"))
        try:
            async with sidecar_on(event_log, Path(scratch) / "s.sock", http=("127.0.0.1", 0)) as sidecar:
                assert sidecar.http_address is not None
                url = f"http://{sidecar.http_address[0]}:{sidecar.http_address[1]}/metrics"

                def get() -> str:
                    with urllib.request.urlopen(url, timeout=10) as response:
                        return str(response.read().decode())

                scan(await anyio.to_thread.run_sync(get))
        finally:
            await event_log.close()
    health = FleetHealth()  # what `kvledger fleet --http` renders on /metrics (coordinator/audit/fleet_http.py)
    health.progressed(10, 12)
    scan(generate_latest(health.registry).decode())
    return names


@pytest.fixture(scope="module")
def served() -> set[str]:
    return anyio.run(exported_names)


def test_every_metric_the_rules_use_is_exported_or_recorded(served: set[str]) -> None:
    rules = rule_documents()
    recorded = {rule["record"] for rule in rules if "record" in rule}
    used = names_in([rule["expr"] for rule in rules])
    assert {
        "kvledger_ready",
        "kvledger_fleet_ready",
        "kvledger_integrity_violations_total",
        "kvledger_oldest_pin_seconds",
        "kvledger_log_append_errors_total",
        "kvledger_lease_expiries_total",
        "kvledger_refusals_total",
        "kvledger_step_seconds_bucket",
    } <= used
    missing = sorted(name for name in used if name not in served and name not in recorded)
    assert not missing, f"the rules use metrics no kvledger process exports: {missing}"
    for name in recorded:
        assert ":" in name, f"{name}: recording rules are named level:metric:operations"


def test_every_metric_the_dashboard_uses_is_exported(served: set[str]) -> None:
    used = names_in(dashboard_expressions())
    assert len(used) >= 15
    missing = sorted(used - served)
    assert not missing, f"the dashboard uses metrics no kvledger process exports: {missing}"


def test_a_renamed_metric_would_be_caught(served: set[str]) -> None:
    """The name check above is not vacuous: the names come from the live exposition."""
    assert "kvledger_step_seconds_bucket" in served and "kvledger_fleet_behind_events" in served
    assert "kvledger_step_second_bucket" not in served


def test_the_dashboard_covers_what_the_issue_names() -> None:
    model = json.loads(DASHBOARD.read_text())
    titles = " | ".join(panel["title"].lower() for panel in walk_panels(model["panels"]))
    for topic in ("step latency", "events", "refusals", "integrity", "lease", "pin", "append errors", "ready", "lag"):
        assert topic in titles, topic
    assert {p["id"] for p in walk_panels(model["panels"])} == set(range(1, len(list(walk_panels(model["panels"]))) + 1))
    assert model["uid"] and model["templating"]["list"][0]["type"] == "datasource"
