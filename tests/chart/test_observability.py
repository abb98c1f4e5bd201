"""The chart's alert rules under promtool (built beside Prometheus by hack/build-prometheus.sh): the
rendered PrometheusRule passes `promtool check rules`, and `promtool test rules` shows each alert firing
on the series that mean trouble and staying silent on healthy ones (synthetic series, Prometheus' own
rule engine). Also: a TTFT SLO that is not a histogram bucket bound is refused at render time (the alert
selects that bucket; any other value would never fire), and the bounds the chart knows are the engine's.

tests/e2e/test_prometheus.py runs the same rules on a real Prometheus scraping real engines.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from images import MONITORS

from kascade_devcluster.prometheus import MissingPrometheus, promtool_binary
from kascade_devcluster.requirement import unavailable
from kascade_engine.metrics import LATENCY

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kascade"
Helm = Callable[..., subprocess.CompletedProcess[str]]
NS, SVC = "team-a", "llama"


def rendered_rules(helm: Helm, *values: str) -> dict[str, Any]:
    out = helm(
        "template",
        "rel",
        str(CHART),
        "--show-only",
        "templates/monitoring.yaml",
        "--set",
        "monitoring.prometheusRule.enabled=true",
        "--api-versions",
        "monitoring.coreos.com/v1/PrometheusRule",
        *values,
    ).stdout
    rule = next(d for d in yaml.safe_load_all(out) if d and d["kind"] == "PrometheusRule")
    return rule["spec"]


@pytest.fixture(scope="module")
def promtool() -> Path:
    try:
        return promtool_binary()
    except MissingPrometheus as e:
        unavailable(str(e))


def test_ttft_slo_must_be_a_bucket_bound_of_the_engine_histogram(helm: Helm) -> None:
    sys.path.insert(0, str(REPO / "hack"))
    try:
        from observability import TTFT_BOUNDS
    finally:
        sys.path.remove(str(REPO / "hack"))
    # Helm's toString of each engine bound (1 -> "1", 0.5 -> "0.5")
    assert tuple(f"{b:g}" for b in LATENCY) == TTFT_BOUNDS
    bad = helm(
        "template",
        "rel",
        str(CHART),
        "--set",
        "monitoring.prometheusRule.enabled=true",
        "--api-versions",
        "monitoring.coreos.com/v1/PrometheusRule",
        "--set-json",
        "monitoring.prometheusRule.ttftSloSeconds=0.3",
        check=False,
    )
    assert bad.returncode != 0
    assert "monitoring.prometheusRule.ttftSloSeconds: 0.3 is not a bucket bound" in bad.stderr, bad.stderr
    for slo, le in (("1", "1"), ("2.5", "2.5")):
        expr = next(
            r["expr"]
            for g in rendered_rules(helm, "--set-json", f"monitoring.prometheusRule.ttftSloSeconds={slo}")["groups"]
            for r in g["rules"]
            if r["alert"] == "KascadeTTFTSLOBurn"
        )
        assert f'le=~"{le}(\\\\.0)?"' in expr, expr


def _annotations(rule: dict[str, Any], labels: dict[str, str]) -> dict[str, str]:
    """The rule's annotations as Prometheus renders them for an alert with these labels."""
    return {k: re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m.group(1), ""), v)
            for k, v in rule["annotations"].items()}


def _alert(rules: dict[str, dict[str, Any]], name: str, **labels: str) -> dict[str, Any]:
    full = {**labels, "severity": rules[name]["labels"]["severity"]}
    return {"exp_labels": full, "exp_annotations": _annotations(rules[name], full)}


def _cases(rules: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One promtool test group per situation (default thresholds: stuck after 5 min, TTFT SLO 0.5 s at 10 %)."""
    svc = f'namespace="{NS}", model_service="{SVC}"'
    replicas = "kascade_operator_replicas{" + svc + ', role="colocated", state="%s"}'

    def group(series: list[tuple[str, str]], checks: list[tuple[str, str, list[dict[str, Any]]]]) -> dict[str, Any]:
        return {"interval": "1m", "input_series": [{"series": s, "values": v} for s, v in series],
                "alert_rule_test": [{"eval_time": t, "alertname": a, "exp_alerts": e} for t, a, e in checks]}

    return [
        # a ScalePlan whose age keeps growing: silent until it is older than 5 min for 1 min, then firing
        group(
            [(f"kascade_operator_scaleplan_oldest_active_seconds{{{svc}}}", "0+60x12")],
            [
                ("5m", "KascadeScaleUpStuck", []),
                ("6m", "KascadeScaleUpStuck", []),
                ("8m", "KascadeScaleUpStuck", [_alert(rules, "KascadeScaleUpStuck", namespace=NS, model_service=SVC)]),
            ],
        ),
        # plans that finish (age back to 0 each time) never fire
        group(
            [(f"kascade_operator_scaleplan_oldest_active_seconds{{{svc}}}", "0 120 240 0 120 240 0 120 240 0")],
            [("9m", "KascadeScaleUpStuck", [])],
        ),
        # the pool is empty and 3 replicas are wanted, 2 exist: fires after 2 min
        group(
            [
                (f'kascade_operator_pool_idle_pods{{namespace="{NS}"}}', "0x10"),
                (replicas % "desired", "3x10"),
                (replicas % "ready", "1x10"),
                (replicas % "loading", "1x10"),
            ],
            [
                ("1m", "KascadeWarmPoolExhausted", []),
                ("5m", "KascadeWarmPoolExhausted", [_alert(rules, "KascadeWarmPoolExhausted", namespace=NS)]),
            ],
        ),
        # an empty pool with every wanted replica present is fine; so is a short pool with idle pods left
        group(
            [
                (f'kascade_operator_pool_idle_pods{{namespace="{NS}"}}', "0x5 1x5"),
                (replicas % "desired", "2x5 3x5"),
                (replicas % "ready", "2x10"),
                (replicas % "loading", "0x10"),
            ],
            [("4m", "KascadeWarmPoolExhausted", []), ("10m", "KascadeWarmPoolExhausted", [])],
        ),
        # one engine's transfer failed (the plan may have recovered): fires at once
        group(
            [
                (f'kascade_weight_transfer_failures_total{{{svc}, pod="p1"}}', "0 0 0 1 1 1"),
                (f'kascade_weight_transfer_failures_total{{{svc}, pod="p2"}}', "0x5"),
            ],
            [
                ("2m", "KascadeTransferFailures", []),
                (
                    "4m",
                    "KascadeTransferFailures",
                    [_alert(rules, "KascadeTransferFailures", namespace=NS, model_service=SVC)],
                ),
            ],
        ),
        # a ScalePlan that ended Failed fires too; Succeeded ones do not
        group(
            [
                (f'kascade_operator_plan_duration_seconds_count{{{svc}, phase="Failed"}}', "0 0 1 1"),
                (f'kascade_operator_plan_duration_seconds_count{{{svc}, phase="Succeeded"}}', "0 1 2 3"),
            ],
            [
                ("1m", "KascadeTransferFailures", []),
                (
                    "3m",
                    "KascadeTransferFailures",
                    [_alert(rules, "KascadeTransferFailures", namespace=NS, model_service=SVC)],
                ),
            ],
        ),
        # half the requests wait longer than the 0.5 s SLO for their first token, for 5 min: critical
        group(
            [
                (f'kascade_time_to_first_token_seconds_bucket{{{svc}, pod="p1", le="0.5"}}', "0+5x20"),
                (f'kascade_time_to_first_token_seconds_count{{{svc}, pod="p1"}}', "0+10x20"),
            ],
            [
                ("4m", "KascadeTTFTSLOBurn", []),
                ("12m", "KascadeTTFTSLOBurn", [_alert(rules, "KascadeTTFTSLOBurn", namespace=NS, model_service=SVC)]),
            ],
        ),
        # 5 % over the SLO is inside the 10 % budget
        group(
            [
                (f'kascade_time_to_first_token_seconds_bucket{{{svc}, pod="p1", le="0.5"}}', "0+19x20"),
                (f'kascade_time_to_first_token_seconds_count{{{svc}, pod="p1"}}', "0+20x20"),
            ],
            [("12m", "KascadeTTFTSLOBurn", [])],
        ),
    ]


def test_alert_rules_pass_promtool_and_fire_exactly_when_they_should(helm: Helm, promtool: Path,
                                                                      tmp_path: Path) -> None:
    spec = rendered_rules(helm)
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(yaml.safe_dump(spec))
    check = subprocess.run(
        [str(promtool), "check", "rules", str(rules_file)], capture_output=True, text=True, timeout=120
    )
    assert check.returncode == 0 and "SUCCESS: 4 rules found" in check.stdout, check.stdout + check.stderr

    rules = {r["alert"]: r for g in spec["groups"] for r in g["rules"]}
    cases = _cases(rules)
    assert {c["alert_rule_test"][0]["alertname"] for c in cases} == set(rules), "every alert has a unit test"
    tests_file = tmp_path / "rules_test.yaml"
    tests_file.write_text(
        yaml.safe_dump({"rule_files": [rules_file.name], "evaluation_interval": "1m", "tests": cases})
    )
    run = subprocess.run([str(promtool), "test", "rules", str(tests_file)], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert run.returncode == 0 and "SUCCESS" in run.stdout, run.stdout + run.stderr


def test_promtool_test_rules_can_fail(helm: Helm, promtool: Path, tmp_path: Path) -> None:
    """The harness is not vacuous: a healthy situation claimed to fire is reported as a failure."""
    spec = rendered_rules(helm)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(spec))
    rules = {r["alert"]: r for g in spec["groups"] for r in g["rules"]}
    wrong = {"interval": "1m",
             "input_series": [{"series": f'kascade_operator_pool_idle_pods{{namespace="{NS}"}}', "values": "1x10"}],
             "alert_rule_test": [{"eval_time": "5m", "alertname": "KascadeWarmPoolExhausted",
                                  "exp_alerts": [_alert(rules, "KascadeWarmPoolExhausted", namespace=NS)]}]}
    (tmp_path / "t.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "tests": [wrong]}))
    run = subprocess.run(
        [str(promtool), "test", "rules", "t.yaml"], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert run.returncode != 0 and "KascadeWarmPoolExhausted" in (run.stdout + run.stderr), run.stdout + run.stderr


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    ok = all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())
    for e in selector.get("matchExpressions") or []:
        ok = ok and {"Exists": e["key"] in labels, "DoesNotExist": e["key"] not in labels,
                     "In": labels.get(e["key"]) in (e.get("values") or []),
                     "NotIn": labels.get(e["key"]) not in (e.get("values") or [])}[e["operator"]]
    return ok


def test_monitors_select_exactly_the_objects_that_export_metrics(helm: Helm) -> None:
    """Each ServiceMonitor selects exactly its Service and names a port it has; the PodMonitor selects the
    pool's pods (and nothing else the chart creates) and names their metrics port."""
    out = helm(
        "template",
        "rel",
        str(CHART),
        "-n",
        "ns",
        *MONITORS,
        "--set",
        "router.enabled=true",
    ).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    services = [d for d in docs if d["kind"] == "Service"]
    for sm in (d for d in docs if d["kind"] == "ServiceMonitor"):
        chosen = [s for s in services if _matches(sm["spec"]["selector"], s["metadata"]["labels"])]
        want = {"rel-operator": "rel-operator-metrics", "rel-router": "rel-router-pods"}[sm["metadata"]["name"]]
        assert [s["metadata"]["name"] for s in chosen] == [want], (sm["metadata"]["name"], chosen)
        assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in chosen[0]["spec"]["ports"]}
        assert sm["spec"]["namespaceSelector"]["matchNames"] == ["ns"]
    pm = next(d for d in docs if d["kind"] == "PodMonitor")
    workloads = [d for d in docs if d["kind"] in {"Deployment", "Pod"}]
    pods = {d["metadata"]["name"]: (d["spec"]["template"] if d["kind"] == "Deployment" else d) for d in workloads}
    chosen = [n for n, t in pods.items() if _matches(pm["spec"]["selector"], t["metadata"].get("labels") or {})]
    assert chosen == ["rel-pool"], chosen
    ports = {p["name"] for c in pods["rel-pool"]["spec"]["containers"] for p in c.get("ports") or []}
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] in ports
