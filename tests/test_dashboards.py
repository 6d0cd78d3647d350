"""The Grafana dashboards of deploy/helm/shoal/files/grafana, and proof that every query they run
returns data.

Static checks: each dashboard parses, has a stable uid, a `datasource` variable and the template
variables its queries use; every panel has a PromQL target; every metric a query names is one of
shoal's (the engine's, the gateway's and the worker's registries).

The proof: a real `shoal dev-cluster` (nats-server, a gateway, one worker on MiniLM's installed
weights) scraped every second by a real Prometheus (Debian's `prometheus`, unpacked by `make
tools`), under a short real load. The load also makes the rarer series move honestly: an operator
unloads the model so the next calls wait for a cold load, a call too large for a NATS message goes
through the Object Store, calls with a deadline too short to be met fail (5xx), and one names a
model that does not exist (404). Then every panel's query, with Grafana's variables substituted,
goes through Prometheus's HTTP API and must return a series with a value (not only NaN); every
template variable's `label_values` must list values.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from conftest import MODEL_ID, exposed_metric_names, metric_total, need_tool
from shoal.cluster.cli import free_port

ROOT = Path(__file__).resolve().parents[1]
GRAFANA = ROOT / "deploy" / "helm" / "shoal" / "files" / "grafana"
DASHBOARDS = ("shoal-gateway.json", "shoal-workers.json", "shoal-models.json")
PROMETHEUS = ROOT / ".tools" / "prometheus" / "usr" / "bin" / "prometheus"

# What the proof substitutes for Grafana's interval variables: wide enough that the whole load
# (about 10 s, scraped every second) is inside every rate() window at the evaluation time.
RATE_WINDOW = "30s"
BUILTINS = {
    "__rate_interval": RATE_WINDOW,
    "__interval": "5s",
    "__range": "5m",
    "__range_s": "300",
    "__interval_ms": "5000",
}
# Grafana unit ids the dashboards may use.
UNITS = {"reqps", "ops", "s", "ms", "bytes", "short", "percentunit", "none"}
VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
METRIC = re.compile(r"\b(shoal_[a-z0-9_]+|up)\b")
RANGE = re.compile(r"(?<=[}\w)])\[([^\]]*)\]")  # a range selector's window (not a regex class)
LABEL_VALUES = re.compile(r"^label_values\((?:(.*),\s*)?(\w+)\)$")

pytestmark = pytest.mark.timeout(240)


# --- the dashboards -------------------------------------------------------------------------------


def load(name: str) -> dict:
    return json.loads((GRAFANA / name).read_text())


def panels_of(dashboard: dict) -> list[dict]:
    """Every panel, those inside (collapsed) rows included; rows themselves are not panels here."""
    found = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            found += panel.get("panels", [])
        else:
            found.append(panel)
    return found


def variables_of(dashboard: dict) -> dict[str, dict]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def query_of_variable(variable: dict) -> str:
    query = variable.get("query")
    return (query.get("query") if isinstance(query, dict) else query) or variable.get("definition", "")


def substitute(text: str, variables: dict[str, dict]) -> str:
    """Grafana's variables as the proof evaluates them: every template variable at its All value
    (`.*`), the interval variables at fixed windows. An unknown variable is left for the caller."""

    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name in BUILTINS:
            return BUILTINS[name]
        if name in variables and variables[name]["type"] == "query":
            return variables[name]["allValue"]
        return match.group(0)

    return VARIABLE.sub(value, text)


def targets():
    """(dashboard file, panel title, refId, expr) for every target of every panel."""
    for name in DASHBOARDS:
        for panel in panels_of(load(name)):
            for target in panel.get("targets", []):
                yield name, panel["title"], target.get("refId"), target.get("expr", "")


@pytest.fixture(scope="module")
def metric_names() -> set[str]:
    return set(exposed_metric_names())


# --- static checks ----------------------------------------------------------------------------------


def test_each_dashboard_parses_with_a_stable_uid_and_a_prometheus_datasource_variable():
    uids = []
    for name in DASHBOARDS:
        dashboard = load(name)
        assert dashboard["uid"] == name.removesuffix(".json"), name
        uids.append(dashboard["uid"])
        assert dashboard["title"].startswith("shoal / ") and dashboard["schemaVersion"] >= 36, name
        variables = variables_of(dashboard)
        assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
        assert "model" in variables, name
        for variable in variables.values():
            if variable["type"] == "query":
                assert variable["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, (name, variable)
                assert variable["multi"] and variable["includeAll"] and variable["allValue"] == ".*", (name, variable)
                assert LABEL_VALUES.match(query_of_variable(variable)), (name, variable)
        assert query_of_variable(variables["model"]) == "label_values(shoal_tokens_total, model)"
    assert len(set(uids)) == len(uids)


def test_every_panel_has_a_titled_promql_target_on_the_datasource_variable():
    for name in DASHBOARDS:
        dashboard = load(name)
        ids = [panel["id"] for panel in dashboard["panels"]] + [
            inner["id"] for panel in dashboard["panels"] if panel["type"] == "row" for inner in panel.get("panels", [])
        ]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        titles = [panel["title"] for panel in panels_of(dashboard)]
        assert len(titles) == len(set(titles)), f"{name}: duplicate panel titles"
        for panel in dashboard["panels"]:
            if panel["type"] == "row":
                assert not panel.get("targets"), f"{name}: row {panel['title']!r} has targets"
        for panel in panels_of(dashboard):
            where = f"{name}: {panel['title']!r}"
            assert panel["type"] in ("timeseries", "stat"), where
            assert panel["title"].strip() and panel.get("description", "").strip(), where
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
            assert panel["fieldConfig"]["defaults"]["unit"] in UNITS, where
            pos = panel["gridPos"]
            assert pos["x"] + pos["w"] <= 24 and pos["h"] > 0, where
            assert panel["targets"], f"{where} has no target"
            ref_ids = [t["refId"] for t in panel["targets"]]
            assert len(ref_ids) == len(set(ref_ids)), where
            for target in panel["targets"]:
                assert target.get("expr", "").strip(), f"{where} {target.get('refId')}: no expr"
                assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where


def test_every_metric_a_query_names_is_one_of_shoals(metric_names):
    unknown = []
    for name, title, ref, expr in targets():
        found = set(METRIC.findall(expr))
        assert found, f"{name}: {title!r} {ref} names no metric: {expr}"
        unknown += [f"{name}: {title!r} {ref}: {metric}" for metric in sorted(found - metric_names - {"up"})]
    for name in DASHBOARDS:
        for variable in variables_of(load(name)).values():
            if variable["type"] == "query":
                for metric in set(METRIC.findall(query_of_variable(variable))) - metric_names - {"up"}:
                    unknown.append(f"{name}: variable {variable['name']}: {metric}")
    assert not unknown, "metrics shoal does not export:\n" + "\n".join(unknown)


def test_queries_use_only_defined_variables_and_grafanas_rate_interval():
    for name, title, ref, expr in targets():
        variables = variables_of(load(name))
        left = substitute(expr, variables)
        assert "$" not in left, f"{name}: {title!r} {ref}: an undefined variable in {expr}"
        for window in RANGE.findall(expr):
            assert window == "$__rate_interval", f"{name}: {title!r} {ref}: a fixed window [{window}] in {expr}"
        for selector in re.findall(r"\{([^}]*)\}", expr):  # gateway, worker or server: never all of them
            assert "component" in selector, f"{name}: {title!r} {ref}: a selector without component: {expr}"


# --- the proof: a real Prometheus scraping a real dev-cluster under load ------------------------------


def prometheus_binary() -> str:
    found = str(PROMETHEUS) if PROMETHEUS.is_file() else shutil.which("prometheus")
    if not found:
        need_tool(False, f"prometheus is not installed: `make tools` unpacks Debian's package to {PROMETHEUS}")
    return found


USER_TOKEN = "dashboards-user-token-0123456789"
ADMIN_TOKEN = "dashboards-admin-token-0123456789"
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Prometheus scrapes the gateway and the workers every second.",
    "A small model answers embedding requests from a JetStream work queue.",
    "Grafana draws what the queries return.",
    "Shoal runs small models behind one HTTP front.",
    "Every panel of every dashboard is evaluated against real data.",
]


@dataclass
class Stack:
    gateway: str
    prometheus: str
    at: float  # unix time the panels are evaluated at: after the load, with scrapes of it stored
    started: float
    logs: Path

    def query(self, expr: str) -> list[dict]:
        response = httpx.get(
            f"{self.prometheus}/api/v1/query", params={"query": expr, "time": f"{self.at:.3f}"}, timeout=10
        )
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", f"{expr}: {response.text}"
        return body["data"]["result"]

    def label_values(self, label: str, match: str | None) -> list[str]:
        params = {"start": f"{self.started:.3f}", "end": f"{self.at:.3f}"}
        if match:
            params["match[]"] = match
        response = httpx.get(f"{self.prometheus}/api/v1/label/{label}/values", params=params, timeout=10)
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", f"{label} {match}: {response.text}"
        return body["data"]

    def tail(self) -> str:
        return tail_of(self.logs)


def tail_of(logs: Path) -> str:
    """The end of each part's log (dev-cluster's holds the gateway's and the worker's)."""
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in sorted(logs.glob("*.log")))


def wait_until(check, timeout_s: float, what: str, logs: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{tail_of(logs)}")


def gateway_workers(url: str) -> float:
    return metric_total(f"{url}/metrics", "shoal_gateway_workers", pool="default")


def prometheus_config(gateway_port: int, worker_port: int) -> str:
    return f"""\
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: shoal-gateway
    static_configs:
      - targets: ["127.0.0.1:{gateway_port}"]
        labels: {{component: gateway}}
  - job_name: shoal-worker
    static_configs:
      - targets: ["127.0.0.1:{worker_port}"]
        labels: {{component: worker, pool: default}}
"""


def drive_load(url: str) -> None:
    """About 10 s of real traffic, and the rarer events the dashboards show, each for real."""
    user = {"authorization": f"Bearer {USER_TOKEN}"}
    admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    encode = f"{url}/v1/encode"
    with httpx.Client(timeout=120) as client:
        # An operator unloads the model: the next calls wait for a cold load (loads, evictions,
        # load time, cold-start wait).
        response = client.post(f"{url}/v1/models/{MODEL_ID}/unload", headers=admin)
        assert response.status_code == 200, response.text

        def steady(lane: int) -> None:
            with httpx.Client(timeout=120, headers=user) as own:
                for i in range(12):
                    texts = [TEXTS[(lane + i + k) % len(TEXTS)] + f" ({lane}.{i}.{k})" for k in range(1 + i % 4)]
                    response = own.post(encode, json={"model": MODEL_ID, "items": [{"text": t} for t in texts]})
                    assert response.status_code == 200, response.text
                    time.sleep(0.7)

        def rare() -> None:
            with httpx.Client(timeout=120, headers=user) as own:
                time.sleep(2.0)
                # Over NATS's 1 MiB message limit both ways: long in bytes (whitespace), short in
                # tokens; its 700 x 384 float32 result is over the limit too.
                big = [{"text": f"{TEXTS[i % len(TEXTS)]}{' ' * 1500}({i})"} for i in range(700)]
                response = own.post(
                    encode, json={"model": MODEL_ID, "items": big}, headers={"accept": "application/msgpack"}
                )
                assert response.status_code == 200, response.text[:500]
                # A model nobody has: 404, recorded with model "-".
                assert own.post(encode, json={"model": "no/such-model", "items": [{"text": "x"}]}).status_code == 404
                # Deadlines too short to meet: 5xx, and calls the gateway abandons.
                for _ in range(3):
                    response = own.post(
                        encode,
                        json={"model": MODEL_ID, "items": [{"text": "too late"}], "options": {"timeout_s": 0.001}},
                    )
                    assert response.status_code >= 500, response.text
                    time.sleep(0.5)

        with ThreadPoolExecutor(4) as pool:
            for future in [pool.submit(steady, lane) for lane in range(3)] + [pool.submit(rare)]:
                future.result()


def stop(process: subprocess.Popen | None, timeout_s: float = 60.0) -> None:
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Stack:
    binary = prometheus_binary()
    root = tmp_path_factory.mktemp("dashboards")
    gateway_port, worker_port, prometheus_port = free_port(), free_port(), free_port()
    url = f"http://127.0.0.1:{gateway_port}"
    prometheus_url = f"http://127.0.0.1:{prometheus_port}"
    (root / "prometheus.yml").write_text(prometheus_config(gateway_port, worker_port))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "SHOAL_AUTH_TOKENS": USER_TOKEN, "SHOAL_ADMIN_TOKENS": ADMIN_TOKEN}
    cluster = prometheus = None
    started = time.time()
    # Prometheus first: it scrapes every part from its first /metrics page on, so series that
    # start at 0 are stored before they move.
    with open(root / "prometheus.log", "wb") as prometheus_log, open(root / "dev-cluster.log", "wb") as cluster_log:
        try:
            prometheus = subprocess.Popen(
                [
                    binary,
                    f"--config.file={root / 'prometheus.yml'}",
                    f"--storage.tsdb.path={root / 'data'}",
                    f"--web.listen-address=127.0.0.1:{prometheus_port}",
                ],
                stdout=prometheus_log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            cluster = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "shoal.cli",
                    "dev-cluster",
                    "--workers",
                    "1",
                    "--port",
                    str(gateway_port),
                    "--metrics-port",
                    str(worker_port),
                    "--models",
                    MODEL_ID,
                    "--preload",
                    MODEL_ID,
                    "--default-model",
                    MODEL_ID,
                    "--store-dir",
                    str(root / "jetstream"),
                    "--stop-timeout-s",
                    "15",
                ],
                env=env,
                stdout=cluster_log,
                stderr=subprocess.STDOUT,
            )
            yield _prove(root, url, prometheus_url, worker_port, started, prometheus, cluster)
        finally:
            stop(cluster)  # it stops the gateway, drains the worker and stops nats-server
            stop(prometheus)


def _prove(
    root: Path,
    url: str,
    prometheus_url: str,
    worker_port: int,
    started: float,
    prometheus: subprocess.Popen,
    cluster: subprocess.Popen,
) -> Stack:
    """Waits for the stack, drives the load, waits for Prometheus to store its scrapes."""

    def alive() -> None:
        for name, process in (("prometheus", prometheus), ("dev-cluster", cluster)):
            assert process.poll() is None, f"{name} exited with {process.returncode}"

    def ready() -> bool:
        alive()
        return (
            httpx.get(f"{prometheus_url}/-/ready", timeout=2).status_code == 200
            and httpx.get(f"{url}/readyz", timeout=2).status_code == 200
            and httpx.get(f"http://127.0.0.1:{worker_port}/readyz", timeout=2).status_code == 200
            and gateway_workers(url) >= 1
        )

    def scraped_since(moment: float) -> bool:
        """Prometheus has stored a successful scrape of both parts taken after `moment`."""
        alive()
        response = httpx.get(f"{prometheus_url}/api/v1/query", params={"query": "timestamp(up == 1)"}, timeout=2)
        result = response.json()["data"]["result"]
        return len(result) == 2 and all(float(r["value"][1]) > moment for r in result)

    wait_until(ready, 150, "the gateway, a live worker and Prometheus", root)
    # The series as they stand before the load are stored first: what the load moves, rate() and
    # increase() then see (a counter's first sample is its baseline, not an increase).
    settled = time.time()
    wait_until(lambda: scraped_since(settled + 1), 30, "scrapes of the idle cluster", root)
    drive_load(url)
    # Two more scrapes of each part after the load (the gateway also polls the queue's consumers
    # every 5 s; the load takes longer than that).
    loaded = time.time()
    wait_until(lambda: scraped_since(loaded + 2), 30, "scrapes after the load", root)
    return Stack(url, prometheus_url, time.time(), started, root)


@pytest.mark.parametrize("name", DASHBOARDS)
def test_every_panel_query_returns_series_from_a_real_prometheus(stack, name):
    dashboard = load(name)
    variables = variables_of(dashboard)
    empty, checked = [], 0
    for panel in panels_of(dashboard):
        for target in panel["targets"]:
            expr = substitute(target["expr"], variables)
            result = stack.query(expr)
            checked += 1
            values = [float(series["value"][1]) for series in result]
            if not values:
                empty.append(f"{name}: {panel['title']!r} {target['refId']}: no series: {expr}")
            elif all(math.isnan(v) for v in values):
                empty.append(f"{name}: {panel['title']!r} {target['refId']}: only NaN: {expr}")
    assert checked and not empty, "panels that would show nothing:\n" + "\n".join(empty) + "\n" + stack.tail()


@pytest.mark.parametrize("name", DASHBOARDS)
def test_every_template_variable_lists_values_from_a_real_prometheus(stack, name):
    variables = variables_of(load(name))
    for variable in variables.values():
        if variable["type"] != "query":
            continue
        match = LABEL_VALUES.match(query_of_variable(variable))
        selector, label = match.group(1), match.group(2)
        values = stack.label_values(label, substitute(selector, variables) if selector else None)
        assert values, f"{name}: variable {variable['name']} ({query_of_variable(variable)}) lists no values"
        if variable["name"] == "model":
            assert MODEL_ID in values, values
        if variable["name"] == "pool":
            assert "default" in values, values
