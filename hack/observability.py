#!/usr/bin/env python3
"""The observability pack's one source: every metric name and PromQL query of the Grafana dashboard and
the alert rules is written here, once.

Generates (and with `--check` only compares, exiting 1 naming stale files):
- charts/kascade/files/dashboards/kascade.json: the Grafana dashboard (the chart ships it in a ConfigMap
  for Grafana's sidecar; import it by hand otherwise);
- charts/kascade/files/dashboards/kascade-router.json: the front door's dashboard (requests held while
  scaling from zero, in flight, by status, tokens, the demand the operator reads), linked both ways;
- charts/kascade/files/prometheus-rules.yaml: the alert rules; the PrometheusRule template renders it
  with `tpl`, so thresholds come from values (monitoring.prometheusRule.*).

Label conventions the queries rely on: engine series carry `namespace`, `pod` and, through the chart's
PodMonitor relabelings, `model_service`, `role` and `pool` (warm/bound) from the pod's kascade.io/*
labels; operator and router series carry `namespace` and `model_service` themselves (their
ServiceMonitors honour labels). tests/e2e/test_prometheus.py runs every query of the main dashboard
against a real Prometheus scraping real engines and the operator; tests/router/test_router_prometheus.py
runs the front door's against a real Prometheus scraping a real router.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "charts" / "kascade" / "files" / "dashboards" / "kascade.json"
ROUTER_DASHBOARD = DASHBOARD.with_name("kascade-router.json")
RULES = REPO / "charts" / "kascade" / "files" / "prometheus-rules.yaml"

# Metric names: rename here when the engine or operator renames a metric.
M = {
    "waiting": "kascade_num_requests_waiting",
    "running": "kascade_num_requests_running",
    "prompt_tokens": "kascade_prompt_tokens_total",
    "generation_tokens": "kascade_generation_tokens_total",
    "kv_usage": "kascade_kv_cache_usage_perc",
    "ttft": "kascade_time_to_first_token_seconds",
    "itl": "kascade_inter_token_latency_seconds",
    "e2e": "kascade_e2e_request_latency_seconds",
    "success": "kascade_request_success_total",
    "preemptions": "kascade_num_preemptions_total",
    "blocks": "kascade_blocks_resident",
    "transfer_bw": "kascade_transfer_bandwidth_bytes_per_second",
    "transfer_failures": "kascade_weight_transfer_failures_total",
    "live_split": "kascade_live_split_requests_total",
    "op_replicas": "kascade_operator_replicas",
    "op_pool_idle": "kascade_operator_pool_idle_pods",
    "op_decisions": "kascade_operator_decisions_total",
    "op_plans_active": "kascade_operator_scaleplans_active",
    "op_plan_age": "kascade_operator_scaleplan_oldest_active_seconds",
    "op_plan_duration": "kascade_operator_plan_duration_seconds",
    "op_reaction": "kascade_operator_reaction_seconds",
    "rt_queued": "kascade_router_queued_requests",
    "rt_in_flight": "kascade_router_in_flight_requests",
    "rt_request_rate": "kascade_router_request_rate",
    "rt_token_rate": "kascade_router_token_rate",
    "rt_requests": "kascade_router_requests_total",
    "rt_tokens": "kascade_router_tokens_total",
}
SEL = 'namespace=~"$namespace", model_service=~"$model_service"'
NS = 'namespace=~"$namespace"'
RATE = "$__rate_interval"


def q(expr: str, legend: str) -> tuple[str, str]:
    return expr, legend


def quantiles(metric: str, by: str = "model_service") -> list[tuple[str, str]]:
    return [q(f"histogram_quantile({p}, sum by (le, {by}) (rate({metric}_bucket{{{SEL}}}[{RATE}])))",
              f"p{int(p * 100)} {{{{{by}}}}}") for p in (0.5, 0.9, 0.99)]


# (title, unit, queries): one panel each, laid out two per row in this order
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    (
        "Replicas by role and state",
        "short",
        [
            q(
                f"sum by (model_service, role, state) ({M['op_replicas']}{{{SEL}}})",
                "{{model_service}} {{role}} {{state}}",
            )
        ],
    ),
    (
        "Engines by pool state",
        "short",
        [
            q(f"count by (pool) ({M['blocks']}{{{NS}}})", "{{pool}}"),
            q(f"sum by (namespace) ({M['op_pool_idle']}{{{NS}}})", "idle in pool {{namespace}}"),
        ],
    ),
    (
        "Generation tokens/s",
        "short",
        [q(f"sum by (model_service) (rate({M['generation_tokens']}{{{SEL}}}[{RATE}]))", "{{model_service}}")],
    ),
    (
        "Prompt tokens/s",
        "short",
        [q(f"sum by (model_service) (rate({M['prompt_tokens']}{{{SEL}}}[{RATE}]))", "{{model_service}}")],
    ),
    ("Time to first token", "s", quantiles(M["ttft"])),
    ("Inter-token latency", "s", quantiles(M["itl"])),
    ("End-to-end request latency", "s", quantiles(M["e2e"])),
    (
        "Finished requests/s by model and reason",
        "reqps",
        [
            q(
                f"sum by (model_name, finished_reason) (rate({M['success']}{{{SEL}}}[{RATE}]))",
                "{{model_name}} {{finished_reason}}",
            )
        ],
    ),
    (
        "Requests waiting and running",
        "short",
        [
            q(f"sum by (model_service) ({M['waiting']}{{{SEL}}})", "waiting {{model_service}}"),
            q(f"sum by (model_service) ({M['running']}{{{SEL}}})", "running {{model_service}}"),
        ],
    ),
    (
        "KV cache usage and preemptions",
        "percentunit",
        [
            q(f"avg by (model_service) ({M['kv_usage']}{{{SEL}}})", "{{model_service}}"),
            q(f"sum by (model_service) (increase({M['preemptions']}{{{SEL}}}[{RATE}]))", "preempted {{model_service}}"),
        ],
    ),
    (
        "Scale decisions",
        "short",
        [
            q(
                f"sum by (model_service, role, policy, direction) (increase({M['op_decisions']}{{{SEL}}}[{RATE}]))",
                "{{model_service}} {{role}} {{policy}} {{direction}}",
            )
        ],
    ),
    (
        "ScalePlans in flight",
        "short",
        [
            q(f"sum by (model_service) ({M['op_plans_active']}{{{SEL}}})", "active {{model_service}}"),
            q(f"max by (model_service) ({M['op_plan_age']}{{{SEL}}})", "oldest age (s) {{model_service}}"),
        ],
    ),
    (
        "ScalePlan duration by outcome",
        "s",
        [
            q(
                f"histogram_quantile(0.9, sum by (le, model_service, phase) "
                f"(rate({M['op_plan_duration']}_bucket{{{SEL}}}[{RATE}])))",
                "p90 {{model_service}} {{phase}}",
            ),
            q(
                f"sum by (model_service, phase) (increase({M['op_plan_duration']}_count{{{SEL}}}[{RATE}]))",
                "plans {{model_service}} {{phase}}",
            ),
        ],
    ),
    (
        "Weight transfers: throughput and failures",
        "Bps",
        [
            q(f"sum by (model_service) ({M['transfer_bw']}{{{SEL}}})", "{{model_service}}"),
            q(
                f"sum by (model_service) (increase({M['transfer_failures']}{{{SEL}}}[{RATE}]))",
                "failed transfers {{model_service}}",
            ),
        ],
    ),
    (
        "Decision to engines instructed",
        "s",
        [q(f"histogram_quantile(0.9, sum by (le) (rate({M['op_reaction']}_bucket[{RATE}])))", "p90")],
    ),
    (
        "Live split requests/s (loading engines serving with a peer)",
        "short",
        [q(f"sum by (model_service) (rate({M['live_split']}{{{SEL}}}[{RATE}]))", "{{model_service}}")],
    ),
]


# The front door (kascade router), per model: summed over router replicas (each sees its own requests).
ROUTER_PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Requests held (no serving replica: scaling from zero) and in flight", "short", [
        q(f"sum by (model_service) ({M['rt_queued']}{{{SEL}}})", "held {{model_service}}"),
        q(f"sum by (model_service) ({M['rt_in_flight']}{{{SEL}}})", "in flight {{model_service}}")]),
    ("Router requests/s by status", "reqps", [
        q(f"sum by (model_service, code) (rate({M['rt_requests']}{{{SEL}}}[{RATE}]))", "{{model_service}} {{code}}")]),
    ("Router tokens/s (prompt estimated for text)", "short", [
        q(f"sum by (model_service, kind) (rate({M['rt_tokens']}{{{SEL}}}[{RATE}]))", "{{model_service}} {{kind}}")]),
    ("Demand the operator reads (router window)", "short", [
        q(f"sum by (model_service) ({M['rt_request_rate']}{{{SEL}}})", "requests/s {{model_service}}"),
        q(f"sum by (model_service) ({M['rt_token_rate']}{{{SEL}}})", "tokens/s {{model_service}}")]),
]


def dashboard() -> dict[str, Any]:
    return _dashboard("kascade-overview", "Kascade", PANELS, M["op_replicas"], "Kascade front door")


def router_dashboard() -> dict[str, Any]:
    return _dashboard("kascade-router", "Kascade front door", ROUTER_PANELS, M["rt_in_flight"], "Kascade")


def _dashboard(uid: str, title: str, spec: list[tuple[str, str, list[tuple[str, str]]]], var_metric: str,
               other: str) -> dict[str, Any]:
    panels = []
    for i, (title_, unit, queries) in enumerate(spec):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": title_,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
            "targets": [{"refId": chr(ord("A") + j), "expr": e, "legendFormat": legend,
                         "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                        for j, (e, legend) in enumerate(queries)],
        })

    def var(name: str, query: str) -> dict[str, Any]:
        return {"name": name, "type": "query", "label": name, "includeAll": True, "multi": True, "allValue": ".*",
                "current": {"selected": True, "text": "All", "value": "$__all"}, "refresh": 2,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "definition": query, "query": {"query": query, "refId": name}}

    return {
        "uid": uid, "title": title, "tags": ["kascade", "llm", "autoscaling"],
        "schemaVersion": 39, "version": 1, "editable": True, "graphTooltip": 1,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "10s",
        # the other Kascade dashboard, keeping the time range and variables
        "links": [{"type": "dashboards", "tags": ["kascade"], "asDropdown": False, "title": other,
                   "includeVars": True, "keepTime": True}],
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus",
             "current": {}, "hide": 0},
            var("namespace", f"label_values({var_metric}, namespace)"),
            var("model_service", f'label_values({var_metric}{{namespace=~"$namespace"}}, model_service)'),
        ]},
        "panels": panels,
    }


# Alerts. `{{ ... }}` inside `expr` is Helm (rendered by the PrometheusRule template with `tpl`);
# `{{ "{{" }} $labels.x {{ "}}" }}` survives Helm as Prometheus' own template syntax.
def _lbl(name: str) -> str:
    return '{{ "{{" }} $labels.' + name + ' {{ "}}" }}'


V = ".Values.monitoring.prometheusRule"
ALERTS: list[dict[str, Any]] = [
    {
        "alert": "KascadeScaleUpStuck",
        "expr": f"max by (namespace, model_service) ({M['op_plan_age']}) > {{{{ mul 60 {V}.scaleUpStuckMinutes }}}}",
        "for": "1m",
        "severity": "warning",
        "summary": f"ScalePlan of {_lbl('namespace')}/{_lbl('model_service')} unfinished for too long",
        "description": "A ScalePlan has been running longer than expected: check `kubectl describe splan` for "
        "the stuck target and the operator log.",
    },
    {
        "alert": "KascadeWarmPoolExhausted",
        "expr": f"(sum by (namespace) ({M['op_pool_idle']}) == 0) and on (namespace) "
        f'(sum by (namespace) ({M["op_replicas"]}{{state="desired"}}) > '
        f'sum by (namespace) ({M["op_replicas"]}{{state=~"ready|loading"}}))',
        "for": "2m",
        "severity": "warning",
        "summary": f"warm pool of {_lbl('namespace')} is empty while replicas are wanted",
        "description": "Scale-ups fall back to creating pods (slow, cold). Raise pool.replicas or add GPU nodes.",
    },
    {
        "alert": "KascadeTransferFailures",
        # an engine's failed transfer counts even when the operator recovered the plan (re-planned around it)
        "expr": f"(sum by (namespace, model_service) (increase({M['transfer_failures']}[15m])) > 0) or "
        f'(sum by (namespace, model_service) (increase({M["op_plan_duration"]}_count{{phase="Failed"}}[15m])) > 0)',
        "for": "0m",
        "severity": "warning",
        "summary": f"weight transfers or ScalePlans of {_lbl('namespace')}/{_lbl('model_service')} failed "
        "in the last 15 minutes",
        "description": "Weight transfers or binds failed: see the engines' loadError (kascade status), the "
        "ScalePlans' status.targets[].failed and Events.",
    },
    {
        "alert": "KascadeTTFTSLOBurn",
        "expr": f"(1 - sum by (namespace, model_service) "
        f'(rate({M["ttft"]}_bucket{{le=~"{{{{ {V}.ttftSloSeconds }}}}(\\\\.0)?"}}[5m])) '
        f"/ sum by (namespace, model_service) (rate({M['ttft']}_count[5m]))) > {{{{ {V}.ttftBurnRatio }}}}",
        "for": "5m",
        "severity": "critical",
        "summary": f"{_lbl('model_service')}: too many requests over the TTFT SLO",
        "description": "More than the allowed share of requests waited longer than the TTFT SLO for their first "
        "token: scale-up is not keeping up (see the ScalePlans and the warm pool).",
    },
]


# kascade_time_to_first_token_seconds' bucket bounds (engine/kascade_engine/metrics.py LATENCY, as Helm's
# toString prints them; a test keeps the two equal): the SLO burn alert selects the bucket `le` equal to
# the SLO, so any other value would give an alert that evaluates fine and can never fire.
TTFT_BOUNDS = ("0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1", "2.5", "5", "10", "30", "60")


def _slo_guard() -> list[str]:
    bounds = " ".join(f'"{b}"' for b in TTFT_BOUNDS)
    return [f"{{{{- $slo := toString {V}.ttftSloSeconds }}}}",
            f"{{{{- if not (has $slo (list {bounds})) }}}}",
            f'{{{{- fail (printf "monitoring.prometheusRule.ttftSloSeconds: %s is not a bucket bound of '
            f'{M["ttft"]} (one of {", ".join(TTFT_BOUNDS)}): the TTFT SLO burn alert could never fire" $slo) }}}}',
            "{{- end }}"]


def rules_yaml() -> str:
    lines = ["# GENERATED by hack/observability.py; edit that file, then run `make manifests`.",
             "# Rendered by templates/monitoring.yaml with `tpl`: thresholds are Helm expressions on .Values.",
             *_slo_guard(),
             "groups:", "  - name: kascade", "    rules:"]
    for a in ALERTS:
        # block scalars: no YAML escaping, so Helm sees its {{ }} and PromQL its quotes exactly as written
        lines += [f"      - alert: {a['alert']}",
                  "        expr: |-", f"          {a['expr']}",
                  f"        for: {a['for']}",
                  "        labels:",
                  f"          severity: {a['severity']}",
                  "        annotations:",
                  "          summary: |-", f"            {a['summary']}",
                  "          description: |-", f"            {a['description']}"]
    return "\n".join(lines) + "\n"


def expected() -> dict[Path, str]:
    return {DASHBOARD: json.dumps(dashboard(), indent=2) + "\n",
            ROUTER_DASHBOARD: json.dumps(router_dashboard(), indent=2) + "\n", RULES: rules_yaml()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only report stale files")
    args = ap.parse_args()
    stale = [p for p, text in expected().items() if not p.exists() or p.read_text() != text]
    if args.check:
        if stale:
            print("out of date (run `make manifests`): " + ", ".join(str(p.relative_to(REPO)) for p in stale),
                  file=sys.stderr)
            return 1
        return 0
    for p, text in expected().items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
