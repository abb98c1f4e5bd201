"""A prometheus-operator PodMonitor (as the chart renders it) turned into a Prometheus scrape config, the
way prometheus-operator does it, so a real Prometheus with Kubernetes service discovery scrapes what the
chart's PodMonitor would select, labelled by the chart's own relabelings.

Data flow: `helm template` -> PodMonitor dict -> `scrape_configs(podmonitor, kubeconfig)` -> one scrape
job per `podMetricsEndpoints` entry: `kubernetes_sd_configs` (role pod, the monitor's namespaces) ->
keep the pods its selector matches and the container port it names -> `namespace`/`pod`/`container`
labels -> the monitor's relabelings, verbatim (camelCase keys become Prometheus' snake_case).

HTTPS (the chart's dataPlaneTls): an endpoint's `scheme` and `tlsConfig` become the job's `scheme` and
`tls_config`; the CA Secret reference is resolved through `secret_files` ((secret, key) -> a local file,
what prometheus-operator mounts into the Prometheus pod), `serverName` and `insecureSkipVerify` are kept.

One deviation, for the local harness only (`address_annotation`): engine processes run on loopback, not
at the KWOK pod's IP, so the target address is taken from the pod's `kascade.io/endpoint` annotation
after every other rule ran (a pod without it is dropped).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any


def _meta_label(key: str) -> str:
    """A Kubernetes label key as Prometheus' pod SD names it (every non-alphanumeric character -> _)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


def _selector_rules(selector: dict[str, Any]) -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = []
    for k, v in (selector.get("matchLabels") or {}).items():
        rules.append({"action": "keep", "source_labels": [f"__meta_kubernetes_pod_label_{_meta_label(k)}",
                                                          f"__meta_kubernetes_pod_labelpresent_{_meta_label(k)}"],
                      "regex": f"({re.escape(v)});true"})
    for e in selector.get("matchExpressions") or []:
        name, op, values = _meta_label(e["key"]), e["operator"], e.get("values") or []
        present = f"__meta_kubernetes_pod_labelpresent_{name}"
        if op == "Exists":
            rules.append({"action": "keep", "source_labels": [present], "regex": "true"})
        elif op == "DoesNotExist":
            rules.append({"action": "drop", "source_labels": [present], "regex": "true"})
        elif op in ("In", "NotIn"):
            rules.append({"action": "keep" if op == "In" else "drop",
                          "source_labels": [f"__meta_kubernetes_pod_label_{name}", present],
                          "regex": f"({'|'.join(re.escape(v) for v in values)});true"})
        else:
            raise ValueError(f"selector.matchExpressions: unknown operator {op!r}")
    return rules


def _relabel(rule: dict[str, Any]) -> dict[str, Any]:
    keys = {"sourceLabels": "source_labels", "targetLabel": "target_label", "replacement": "replacement",
            "regex": "regex", "action": "action", "separator": "separator", "modulus": "modulus"}
    unknown = set(rule) - set(keys)
    if unknown:
        raise ValueError(f"relabelings: unknown keys {sorted(unknown)}")
    return {keys[k]: v for k, v in rule.items()}


def endpoint_tls(ep: dict[str, Any], secret_files: dict[tuple[str, str], Path] | None = None) -> dict[str, Any]:
    """The scrape job keys for a PodMonitor endpoint's `scheme` and `tlsConfig` ({} for plain HTTP)."""
    out: dict[str, Any] = {}
    if "scheme" in ep:
        out["scheme"] = ep["scheme"]
    tls = ep.get("tlsConfig")
    if tls:
        unknown = set(tls) - {"ca", "serverName", "insecureSkipVerify"}
        if unknown:
            raise ValueError(f"tlsConfig: unknown keys {sorted(unknown)}")
        cfg: dict[str, Any] = {}
        if "ca" in tls:
            ref = tls["ca"]["secret"]
            cfg["ca_file"] = str((secret_files or {})[(ref["name"], ref["key"])])
        if "serverName" in tls:
            cfg["server_name"] = tls["serverName"]
        if "insecureSkipVerify" in tls:
            cfg["insecure_skip_verify"] = bool(tls["insecureSkipVerify"])
        out["tls_config"] = cfg
    return out


def scrape_configs(podmonitor: dict[str, Any], kubeconfig: Path, interval: str | None = None,
                   address_annotation: str | None = None,
                   secret_files: dict[tuple[str, str], Path] | None = None) -> list[dict[str, Any]]:
    meta, spec = podmonitor["metadata"], podmonitor["spec"]
    namespaces = (spec.get("namespaceSelector") or {}).get("matchNames") or [meta["namespace"]]
    jobs = []
    for i, ep in enumerate(spec["podMetricsEndpoints"]):
        rules = [*_selector_rules(spec["selector"]),
                 # as prometheus-operator: finished pods are not scraped
                 {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"},
                 {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                  "regex": re.escape(ep["port"])},
                 {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                 {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                 {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
                 *(_relabel(r) for r in ep.get("relabelings") or [])]
        if address_annotation:
            ann = f"__meta_kubernetes_pod_annotation_{_meta_label(address_annotation)}"
            rules += [{"action": "keep", "source_labels": [ann], "regex": ".+"},
                      {"source_labels": [ann], "target_label": "__address__"}]
        job: dict[str, Any] = {
            "job_name": f"podMonitor/{meta['namespace']}/{meta['name']}/{i}",
            "metrics_path": ep.get("path", "/metrics"),
            "kubernetes_sd_configs": [{"role": "pod", "kubeconfig_file": str(kubeconfig),
                                       "namespaces": {"names": list(namespaces)}}],
            "relabel_configs": rules, **endpoint_tls(ep, secret_files)}
        if interval or ep.get("interval"):
            job["scrape_interval"] = interval or ep["interval"]
            job["scrape_timeout"] = job["scrape_interval"]
        jobs.append(job)
    return jobs
