"""The Prometheus rules of the Helm chart (deploy/helm/shoal/files/prometheus/): `promtool check
rules` loads them, `promtool test rules` runs their unit tests (rules.test.yaml), the alerts the
operations docs promise exist, and every shoal metric the rules (and their tests) name is one
shoal's metric classes really expose, under the name Prometheus scrapes (`_total`, `_bucket`...).

promtool comes from `make tools` (Debian's prometheus package, unpacked under .tools/). Without it
these tests skip, except under CI (CI=true), where they fail.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from conftest import exposed_metric_names, need_tool
from shoal.cluster.gateway import GatewayMetrics

ROOT = Path(__file__).resolve().parents[1]
RULES_DIR = ROOT / "deploy" / "helm" / "shoal" / "files" / "prometheus"
RULES = RULES_DIR / "rules.yaml"
RULE_TESTS = RULES_DIR / "rules.test.yaml"
PROMTOOL = ROOT / ".tools" / "prometheus" / "usr" / "bin" / "promtool"

# The alerts issue 13 asks for, and the ones added beside them (docs/operations.md lists them all).
ISSUE_ALERTS = {
    "ShoalQueueLagGrowing",
    "ShoalDeadLetters",
    "ShoalHighP99",
    "ShoalModelLoadFailures",
    "ShoalEvictionStorm",
    "ShoalWorkerDown",
    "ShoalGatewayNatsDisconnected",
}
MORE_ALERTS = {"ShoalPoolNoWorkers", "ShoalModelUnserved", "ShoalHighErrorRate", "ShoalApiDown"}

_METRIC = re.compile(r"(?<![A-Za-z0-9_:])shoal_[a-z0-9_]+")
_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")


@pytest.fixture(scope="module")
def promtool() -> Path:
    if not os.access(PROMTOOL, os.X_OK):
        need_tool(False, f"promtool is not at {PROMTOOL.relative_to(ROOT)}: run `make tools`")
    return PROMTOOL


def _run(promtool: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(promtool), *args], check=False, cwd=RULES_DIR, capture_output=True, text=True, timeout=120
    )


def _rules() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _alerts() -> dict[str, list[dict]]:
    alerts: dict[str, list[dict]] = {}
    for rule in _rules():
        if "alert" in rule:
            alerts.setdefault(rule["alert"], []).append(rule)
    return alerts


def _tests() -> list[dict]:
    return yaml.safe_load(RULE_TESTS.read_text())["tests"]


def test_promtool_check_rules(promtool):
    result = _run(promtool, "check", "rules", RULES.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_test_rules(promtool):
    result = _run(promtool, "test", "rules", RULE_TESTS.name)
    assert result.returncode == 0, result.stdout + result.stderr


def test_rule_file_is_a_plain_rule_file():
    """Top-level `groups:` only, so the chart can embed it as a PrometheusRule's `spec`."""
    doc = yaml.safe_load(RULES.read_text())
    assert set(doc) == {"groups"}
    names = [group["name"] for group in doc["groups"]]
    assert len(names) == len(set(names))
    for rule in _rules():
        assert ("alert" in rule) != ("record" in rule), rule
        if "record" in rule:
            assert rule["record"].startswith("shoal:"), rule["record"]


def test_recorded_series_are_read_after_their_rule_in_the_same_group():
    """A rule that reads a recorded series must come after its recording rule, in the same group.
    Rules in one group run in order at one evaluation time, but groups run independently: across
    groups an alert may read the previous evaluation's value, so its firing time (and its
    `$value`) would move by an interval at random, in Prometheus and in `promtool test rules`."""
    doc = yaml.safe_load(RULES.read_text())
    recorded = {rule["record"] for rule in _rules() if "record" in rule}
    for group in doc["groups"]:
        before: set[str] = set()
        for rule in group["rules"]:
            name = rule.get("alert") or rule["record"]
            for used in re.findall(r"(?<![A-Za-z0-9_:])shoal:[A-Za-z0-9_:]+", rule["expr"]):
                assert used in recorded, f"{name} reads {used}, which no rule records"
                assert used in before, f"{name} reads {used}: record it earlier in group {group['name']}"
            if "record" in rule:
                before.add(rule["record"])


def test_issue_alerts_exist():
    alerts = _alerts()
    assert ISSUE_ALERTS <= set(alerts), sorted(ISSUE_ALERTS - set(alerts))
    assert set(alerts) == ISSUE_ALERTS | MORE_ALERTS, "update this test and docs/operations.md together"


def test_alerts_have_severity_for_and_annotations():
    for name, rules in _alerts().items():
        for rule in rules:
            assert rule.get("labels", {}).get("severity") in {"warning", "critical"}, name
            assert "for" in rule, f"{name}: say `for:` explicitly (0m included)"
            annotations = rule.get("annotations", {})
            assert annotations.get("summary") and annotations.get("description"), name


def test_every_alert_is_unit_tested_firing_and_silent():
    """Each alert has a case where it fires and one where it stays silent in rules.test.yaml."""
    fires: set[str] = set()
    silent: set[str] = set()
    for case in _tests():
        for check in case.get("alert_rule_test", []):
            (fires if check.get("exp_alerts") else silent).add(check["alertname"])
    alerts = set(_alerts())
    assert alerts <= fires, f"never shown firing: {sorted(alerts - fires)}"
    assert alerts <= silent, f"never shown silent: {sorted(alerts - silent)}"
    assert fires | silent <= alerts, f"tests of unknown alerts: {sorted((fires | silent) - alerts)}"


def test_every_recording_rule_is_unit_tested():
    tested = " ".join(check["expr"] for case in _tests() for check in case.get("promql_expr_test", []))
    recorded = {rule["record"] for rule in _rules() if "record" in rule}
    untested = {
        name for name in recorded if not re.search(rf"(?<![A-Za-z0-9_:]){re.escape(name)}(?![A-Za-z0-9_:])", tested)
    }
    assert not untested, sorted(untested)


def _exposed() -> dict[str, str]:
    """Every sample name shoal's metric classes expose -> the metric family (as registered)."""
    return exposed_metric_names()


def _family(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _referenced() -> dict[str, set[str]]:
    """shoal_* names in the rule expressions and the test series -> where each is used."""
    used: dict[str, set[str]] = {}
    for rule in _rules():
        for name in _METRIC.findall(rule["expr"]):
            used.setdefault(name, set()).add(rule.get("alert") or rule["record"])
    for case in _tests():
        for series in case.get("input_series", []):
            for name in _METRIC.findall(series["series"].split("{", 1)[0]):
                used.setdefault(name, set()).add(f"rules.test.yaml: {case.get('name', '?')}")
    return used


def test_rules_reference_only_real_metrics():
    exposed = _exposed()
    families = set(exposed.values())
    used = _referenced()
    assert used, "no shoal_ metric found in the rules: the pattern is broken"
    unknown = {name: sorted(where) for name, where in used.items() if _family(name) not in families}
    assert not unknown, f"not registered by Metrics, GatewayMetrics or WorkerMetrics: {unknown}"
    # And under the name Prometheus scrapes: a counter only as `_total`, a histogram's parts...
    misnamed = {name: sorted(where) for name, where in used.items() if name not in exposed}
    assert not misnamed, f"registered, but not exposed under this name: {misnamed}"


def test_queue_gauges_are_the_gateways():
    """The lag alerts read the gateway's JetStream gauges, labelled by pool and model."""
    registry = CollectorRegistry()
    gm = GatewayMetrics(registry)
    labelled = {family.name for family in registry.collect()}
    assert {"shoal_queue_pending_calls", "shoal_queue_unacked_calls"} <= labelled
    for attr in ("queue_pending", "queue_unacked"):
        assert tuple(getattr(gm, attr)._labelnames) == ("pool", "model")
