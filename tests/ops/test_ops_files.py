"""The files in ops/ read against the code: Docker and Kubernetes cannot run here, so every
command must parse with the real CLI, every environment name must be one the code reads, ports
must agree, and every metric an alert rule names must be one a live server exports.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/ops/test_ops_files.py -q
"""

from __future__ import annotations

import hashlib
import re
import shlex
from dataclasses import fields
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from fleet_env import FLEET_ADAPTER_POLL_S, FLEET_SERVE_ENV, FLEET_TRAIN_ENV, HEALTH_PATH

from cli import build_parser
from service.settings import Settings

OPS = Path(__file__).resolve().parents[2] / "ops"
K8S = OPS / "k8s" / "adaptive-spec.yaml"
COMPOSE = OPS / "compose.yaml"
ALERTS = OPS / "prometheus" / "alerts.yml"
# What the server reads (Settings.from_env) plus what the trainer and the CLI read (cli/__init__.py epilog).
SETTINGS_ENV = {"REDIS_URL" if f.name == "redis_url" else Settings.env_name(f.name) for f in fields(Settings)}
KNOWN_ENV = SETTINGS_ENV | {"MLFLOW_TRACKING_URI", "ADAPTIVE_SPEC_DATA_DIR"}
METRIC = re.compile(r"\badaptive_spec:[a-z_:]+")


def k8s_docs() -> list[dict]:
    return [doc for doc in yaml.safe_load_all(K8S.read_text()) if doc]


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def adaptive_spec_containers() -> list[tuple[str, list[str], dict[str, str]]]:
    """(where, command, env) of every container or service that runs `adaptive-spec`."""
    found = []
    for doc in k8s_docs():
        if doc["kind"] != "Deployment":
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            if container.get("command", [None])[0] == "adaptive-spec":
                env = {e["name"]: e.get("value") for e in container.get("env", [])}
                found.append((f"k8s {doc['metadata']['name']}/{container['name']}", container["command"], env))
    for name, service in compose()["services"].items():
        command = service.get("command")
        if command and command[0] == "adaptive-spec":
            found.append((f"compose {name}", command, dict(service.get("environment", {}))))
    return found


def runbook_commands() -> list[list[str]]:
    return [
        shlex.split(line.strip().split("#")[0])
        for line in (OPS / "RUNBOOK.md").read_text().splitlines()
        if line.strip().startswith("adaptive-spec ")
    ]


def parse(command: list[str]):
    """The CLI's own parser; argparse exits on an unknown command or flag."""
    try:
        return build_parser().parse_args(command[1:])
    except SystemExit:
        pytest.fail(f"`{shlex.join(command)}` is not a valid adaptive-spec command line")


def test_the_files_parse_and_run_both_commands_that_the_design_needs():
    roles = {command[1] for _, command, _ in adaptive_spec_containers()}
    assert roles == {"serve", "train"}
    kinds = {(doc["kind"], doc["metadata"]["name"]) for doc in k8s_docs()}
    assert {
        ("Service", "redis"),
        ("Service", "mlflow"),
        ("Deployment", "adaptive-spec-trainer"),
        ("Deployment", "app"),
    } <= kinds
    app = next(doc for doc in k8s_docs() if doc["kind"] == "Deployment" and doc["metadata"]["name"] == "app")
    names = [c["name"] for c in app["spec"]["template"]["spec"]["containers"]]
    assert "adaptive-spec" in names and len(names) == 2  # a sidecar next to the app container


@pytest.mark.parametrize(
    "where, command, env", adaptive_spec_containers(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_every_command_is_a_real_cli_line_with_known_environment(where, command, env):
    args = parse(command)
    assert args.command in {"serve", "train"}
    helpers = {name for value in env.values() if value for name in re.findall(r"\$\((\w+)\)", value)}  # k8s $(NAME)
    unknown = set(env) - KNOWN_ENV - helpers
    assert not unknown, f"{where}: environment names no code reads: {unknown}"
    assert {"REDIS_URL", "MLFLOW_TRACKING_URI"} <= set(env), f"{where}: needs Redis and MLflow"
    if args.command == "serve":
        assert "ADAPTIVE_SPEC_ADMIN_TOKEN" in env and args.host == "0.0.0.0"
    values = {
        name: value
        for name, value in env.items()
        if name in SETTINGS_ENV and value is not None and not value.startswith("$")
    }
    Settings.from_env(values)  # every value parses and passes the settings' checks


def test_the_files_describe_the_fleet_the_fleet_test_runs():
    """N serve replicas, one trainer, Redis, an MLflow server; each process with the environment and
    health path tests/reliability/test_fleet.py gives it (tests/helpers/fleet_env.py)."""
    for where, command, env in adaptive_spec_containers():
        needed = FLEET_SERVE_ENV if command[1] == "serve" else FLEET_TRAIN_ENV
        assert set(needed) <= set(env), f"{where}: lacks {set(needed) - set(env)}"
        if command[1] == "serve":
            assert env["ADAPTIVE_SPEC_ADAPTER_POLL_S"] == FLEET_ADAPTER_POLL_S, where
        else:
            assert parse(command).consumer, where  # one named consumer of the stream's group

    services = compose()["services"]
    replicas = services["adaptive-spec"]["deploy"]["replicas"]
    low, high = services["adaptive-spec"]["ports"][0].split(":")[0].split("-")
    assert replicas >= 2 and int(high) - int(low) + 1 == replicas  # a host port per replica
    assert services["trainer"].get("deploy", {}).get("replicas", 1) == 1
    assert HEALTH_PATH in " ".join(services["adaptive-spec"]["healthcheck"]["test"])
    assert services["mlflow"]["command"][:2] == ["mlflow", "server"] and "redis" in services

    deployments = {doc["metadata"]["name"]: doc for doc in k8s_docs() if doc["kind"] == "Deployment"}
    assert deployments["app"]["spec"]["replicas"] >= 2 and deployments["adaptive-spec-trainer"]["spec"]["replicas"] == 1
    sidecar = next(
        c for c in deployments["app"]["spec"]["template"]["spec"]["containers"] if c["name"] == "adaptive-spec"
    )
    assert sidecar["readinessProbe"]["httpGet"]["path"] == sidecar["livenessProbe"]["httpGet"]["path"] == HEALTH_PATH
    # A first start compiles for minutes: liveness must not restart it (a startup probe holds it off that long).
    startup = sidecar["startupProbe"]
    assert startup["httpGet"]["path"] == HEALTH_PATH and startup["periodSeconds"] * startup["failureThreshold"] >= 600
    assert int(services["adaptive-spec"]["healthcheck"]["start_period"].rstrip("s")) >= 600
    mlflow = deployments["mlflow"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert mlflow[:2] == ["mlflow", "server"] and deployments["redis"]["spec"]["replicas"] == 1


@pytest.mark.parametrize("command", runbook_commands(), ids=shlex.join)
def test_runbook_commands_parse(command):
    parse(command)


def test_ports_and_addresses_agree():
    docs = k8s_docs()
    services = {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == "Service"}
    app = next(doc for doc in docs if doc["kind"] == "Deployment" and doc["metadata"]["name"] == "app")
    pod = app["spec"]["template"]
    sidecar = next(c for c in pod["spec"]["containers"] if c["name"] == "adaptive-spec")
    port = parse(sidecar["command"]).port
    assert [p["containerPort"] for p in sidecar["ports"]] == [port]
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/health", "port": port}
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    assert any(
        e.get("value") == f"http://127.0.0.1:{port}/v1" for c in pod["spec"]["containers"] for e in c.get("env", [])
    )
    created = re.search(r"kubectl create secret generic (\S+)((?:.|\n)*?)kubectl apply", K8S.read_text())
    assert created, "the manifest says how to create its Secret"
    made_keys = set(re.findall(r"--from-literal=([\w-]+)=", created.group(2)))
    for doc in docs:
        for container in doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            for e in container.get("env", []):
                if "valueFrom" in e:  # every secret a container reads is one the command above creates
                    ref = e["valueFrom"]["secretKeyRef"]
                    assert ref["name"] == created.group(1) and ref["key"] in made_keys, (container["name"], ref)
    for _, _, env in adaptive_spec_containers():
        redis_url, mlflow_url = urlsplit(env["REDIS_URL"]), urlsplit(env["MLFLOW_TRACKING_URI"])
        assert redis_url.hostname == "redis" and mlflow_url.hostname == "mlflow"
        assert redis_url.port in {p["port"] for p in services["redis"]["spec"]["ports"]}
        assert mlflow_url.port in {p["port"] for p in services["mlflow"]["spec"]["ports"]}
        mlflow_server = next(doc for doc in docs if doc["kind"] == "Deployment" and doc["metadata"]["name"] == "mlflow")
        mlflow_command = mlflow_server["spec"]["template"]["spec"]["containers"][0]["command"]
        assert mlflow_command[mlflow_command.index("--port") + 1] == str(mlflow_url.port)

    services = compose()["services"]
    serve = parse(services["adaptive-spec"]["command"])
    assert services["adaptive-spec"]["ports"][0].startswith(f"{serve.port}-")  # host ports from the server's
    assert services["adaptive-spec"]["ports"][0].endswith(f":{serve.port}")  # onwards, to each replica's
    scrape = yaml.safe_load((OPS / "prometheus" / "prometheus.yml").read_text())
    found = [sd for job in scrape["scrape_configs"] for sd in job.get("dns_sd_configs", [])]
    assert found == [{"names": ["adaptive-spec"], "type": "A", "port": serve.port}]  # every replica
    mounted = services["prometheus"]["volumes"][0].split(":")[0]
    assert (COMPOSE.parent / mounted / "prometheus.yml").is_file()
    for config in ("prometheus.yml", "prometheus-k8s.yml"):
        rules = yaml.safe_load((OPS / "prometheus" / config).read_text())["rule_files"]
        assert all((OPS / "prometheus" / rule).is_file() for rule in rules)


def test_alert_rules_name_only_metrics_the_server_exports(live_server, tiny_engine, redis_url):
    rules = [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]
    assert {"AdaptiveSpecAcceptanceDrift", "AdaptiveSpecNoTraffic", "AdaptiveSpecRequestsFailing"} <= {
        r["alert"] for r in rules
    }
    for rule in rules:
        assert rule["expr"].count("(") == rule["expr"].count(")"), rule["alert"]
        assert rule["labels"]["severity"] in {"info", "warning", "critical"} and rule["annotations"]["summary"]
    used = {name for rule in rules for name in METRIC.findall(rule["expr"])}
    assert "adaptive_spec:drift_alert" in used
    with live_server(tiny_engine, redis_url=redis_url) as server:
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        httpx.post(
            server.url + "/v1/completions", json={"model": model, "prompt": [1, 2, 3], "max_tokens": 4}, timeout=60
        ).raise_for_status()
        exposition = httpx.get(server.url + "/metrics").text
    exported = set()
    for line in exposition.splitlines():
        match = METRIC.match(line.split(" ", 2)[2] if line.startswith("# HELP ") else line)
        if match:
            exported.add(match.group(0))
    missing = used - exported
    assert not missing, f"alert rules name metrics the server does not export: {missing}"


def test_routes_the_runbook_names_exist(live_server, tiny_engine, redis_url):
    text = (OPS / "RUNBOOK.md").read_text()
    paths = set(re.findall(r"(/(?:dashboard|metrics|health|admin/[a-z/]+|api/stats/[a-z]+))\b", text))
    assert {"/dashboard", "/admin/adapters/rollback", "/api/stats/summary"} <= paths
    with live_server(tiny_engine, redis_url=redis_url) as server:
        for path in sorted(paths):
            if path.startswith("/admin/"):  # POST routes; no admin token is configured: refused, not missing
                assert httpx.post(server.url + path).status_code == 403, path
            else:
                assert httpx.get(server.url + path).status_code == 200, path


def test_the_chart_library_is_vendored_at_a_pinned_version():
    dashboard = OPS.parent / "service" / "static" / "dashboard"
    vendor = dashboard / "vendor"
    readme = (vendor / "README.md").read_text()
    version = re.search(r"uPlot \*\*(\d+\.\d+\.\d+)\*\*", readme).group(1)
    assert f"npm pack uplot@{version}" in readme
    assert (vendor / "uPlot.LICENSE").read_text().startswith("The MIT License")
    for name in ("uPlot.iife.min.js", "uPlot.min.css"):
        digest = hashlib.sha256((vendor / name).read_bytes()).hexdigest()
        assert f"| {name} | {digest} |" in readme, f"{name} changed without its README line"
    page = (dashboard / "index.html").read_text() + (dashboard / "dashboard.js").read_text()
    assert not re.search(r"https?://(?!127\.0\.0\.1)", page.replace("http://www.w3.org", "")), "no external URLs"


def test_no_secret_values_ship_and_redis_and_mlflow_are_not_open():
    """Issue 30, item 5: the manifest carries no Secret (applying it never overwrites real ones) and no
    placeholder values; Redis requires a password that every REDIS_URL carries, keeps at most maxmemory and
    never evicts; compose publishes neither Redis nor MLflow on the host; k8s NetworkPolicies let only the
    sidecars and the trainer reach them."""
    docs = k8s_docs()
    assert not [doc for doc in docs if doc["kind"] == "Secret"]
    for path in (K8S, COMPOSE):
        assert "change-me" not in path.read_text().lower()
    services = compose()["services"]
    assert "ports" not in services["redis"] and "ports" not in services["mlflow"]
    redis_commands = {
        "compose": services["redis"]["command"],
        "k8s": next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "redis")["spec"][
            "template"
        ]["spec"]["containers"][0]["args"],
    }
    for where, command in redis_commands.items():
        flags = {command[i]: command[i + 1] for i in range(len(command) - 1)}
        assert flags.get("--requirepass", "").startswith("$"), where  # from the environment or the Secret
        assert flags.get("--maxmemory") and flags.get("--maxmemory-policy") == "noeviction", where
    for where, _, env in adaptive_spec_containers():
        assert urlsplit(env["REDIS_URL"]).password, f"{where}: REDIS_URL without the Redis password"
        assert "ADAPTIVE_SPEC_SIGNING_KEY" in env, f"{where}: versions must be signed and checked"

    labels = {
        doc["metadata"]["name"]: doc["spec"]["template"]["metadata"]["labels"]["app"]
        for doc in docs
        if doc["kind"] == "Deployment"
    }
    policies = {doc["spec"]["podSelector"]["matchLabels"]["app"]: doc for doc in docs if doc["kind"] == "NetworkPolicy"}
    for guarded in ("redis", "mlflow"):
        policy = policies[guarded]["spec"]
        assert policy["policyTypes"] == ["Ingress"]
        allowed = {
            value
            for rule in policy["ingress"]
            for source in rule["from"]
            for expression in source["podSelector"]["matchExpressions"]
            for value in expression["values"]
        }
        assert allowed == {labels["app"], labels["adaptive-spec-trainer"]}, guarded
