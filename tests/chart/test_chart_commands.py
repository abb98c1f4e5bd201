"""What the chart runs is what the code accepts: the rendered containers' args are parsed by the real
`kascade` CLI (without running anything), and the operator's environment builds its real settings."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from kascade_cli.main import cli
from kascade_operator.settings import OperatorSettings

CHART = Path(__file__).resolve().parents[2] / "charts" / "kascade"
pytestmark = pytest.mark.filterwarnings("ignore:'protected_args' is deprecated")
Helm = Callable[..., subprocess.CompletedProcess[str]]


def containers(helm: Helm, tmp: Path, values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    (tmp / "values.yaml").write_text(yaml.safe_dump(values))
    docs = [
        d for d in yaml.safe_load_all(helm("template", "rel", str(CHART), "-f", str(tmp / "values.yaml")).stdout) if d
    ]
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0] for d in docs
            if d["kind"] == "Deployment"}


def parse(args: list[str]) -> dict[str, Any]:
    """Resolve `kascade ...` down to the leaf command and parse its options, as click would at start-up."""
    assert args[0] == "kascade", args
    ctx = cli.make_context("kascade", list(args[1:]), resilient_parsing=False)
    group, rest = cli, ctx.protected_args + ctx.args
    while isinstance(group, click.Group):
        name, cmd, rest = group.resolve_command(ctx, rest)
        assert cmd is not None, f"unknown command {name}"
        ctx = cmd.make_context(name or "", rest, parent=ctx)
        group, rest = cmd, ctx.protected_args + ctx.args if isinstance(cmd, click.Group) else []
    return dict(ctx.params)


def test_operator_args_and_env_are_real_settings(helm: Helm, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    c = containers(helm, tmp_path, {"operator": {"logLevel": "debug", "watchNamespaces": ["a", "b"],
                                                 "metrics": {"intervalSeconds": 0.25}}})["rel-operator"]
    params = parse(c["args"])
    assert params["liveness"] == "http://0.0.0.0:8080/healthz" and params["metrics_port"] == 9090
    assert c["args"][1] == "-vv"
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    assert all(k.startswith("KASCADE_OPERATOR_") for k in env), env
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s = OperatorSettings()
    assert s.namespaces == ["a", "b"] and s.interval_seconds == 0.25 and s.inter_leaf_ratio == 0.5
    assert s.leaf_label == "kascade.io/leaf" and s.metrics_source == "scrape"
    assert s.engine_token_secret == "rel-engine-token"  # what fallback pods reference
    assert s.pool_namespace == "default"  # the release's namespace: its pool and its Secret live there
    assert s.engine_token_create and s.engine_token_namespace == "default"  # made once by the operator if absent
    assert not [e for e in c["env"] if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]]


def test_pool_engine_args_parse_and_name_the_model(helm: Helm, tmp_path: Path) -> None:
    (tmp_path / "m1").mkdir()  # click checks the checkpoint directory exists, as it would in the pod
    c = containers(helm, tmp_path, {"pool": {"model": {"name": "m1", "path": str(tmp_path / "m1"),
                                                       "mountPath": str(tmp_path)}}})["rel-pool"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    params = parse(c["args"])
    assert params["empty"] and params["model_name"] == "m1" and params["host"] == "0.0.0.0"
    assert params["port"] == ports["http"] and params["act_port"] == ports["act"] and "data" in ports
    assert params["checkpoint"] == tmp_path / "m1"
    # pool.engine: the capacity flags the real CLI takes (the engine's own defaults unless set); no
    # --max-prompt-tokens by default (maxPromptTokens 0): the engine takes the model's context
    assert (params["kv_tokens"], params["max_prompt_tokens"], params["max_seqs"], params["max_batch_tokens"],
            params["dtype"]) == (65536, None, 64, 512, "auto")
    assert not [a for a in c["args"] if a.startswith("--max-prompt-tokens")]


def test_pool_download_and_helm_test_commands_parse(helm: Helm, tmp_path: Path) -> None:
    """The pool's init container and the `helm test` pod run real `kascade` commands with these options."""
    (tmp_path / "values.yaml").write_text(yaml.safe_dump({"pool": {"model": {"download": {"revision": "v1"}}},
                                                          "logFormat": "json"}))
    docs = [d for d in yaml.safe_load_all(helm("template", "rel", str(CHART), "-n", "ns", "-f",
                                                str(tmp_path / "values.yaml")).stdout) if d]
    pool = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "rel-pool")
    init = pool["spec"]["template"]["spec"]["initContainers"][0]
    params = parse(init["args"])
    assert params == {
        "repo": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "dest": Path("/models/smollm2-135m"),
        "revision": "v1",
        "config_only": False,
    }
    test = next(d for d in docs if d["kind"] == "Pod")
    params = parse(test["spec"]["containers"][0]["args"])
    assert params["url"] == "http://rel-router.ns.svc:8080"  # the front door: the router (on by default)
    assert params["expect_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and params["timeout"] == 60
    root = cli.make_context("kascade", list(test["spec"]["containers"][0]["args"][1:]))
    assert root.params["log_format"] == "json"


def test_pool_without_a_model_is_refused(helm: Helm) -> None:
    out = helm("template", "rel", str(CHART), "--set", "pool.model.name=", check=False)
    assert out.returncode != 0 and "/pool/model/name" in out.stderr


def test_fallback_pod_runs_a_real_engine_command(helm: Helm, tmp_path: Path) -> None:
    from kascade_operator.api import ModelServiceSpec
    from kascade_operator.podtemplate import fallback_pod

    ckpt = tmp_path / "m"
    ckpt.mkdir()
    spec = ModelServiceSpec.model_validate({"model": {"name": "m", "source": {"path": str(ckpt)}},
                                            "engine": {"image": "img:1", "port": 8100}, "mode": "colocated",
                                            "replicas": {"colocated": {"min": 1, "max": 2}}})
    pod = fallback_pod(spec, "svc", "tok", None)
    c = pod["spec"]["containers"][0]
    params = parse(c["args"])
    assert params["checkpoint"] == ckpt and params["model_name"] == "m" and params["port"] == 8100 and params["empty"]
    assert pod["spec"]["volumes"][0]["hostPath"]["path"] == str(ckpt) == c["volumeMounts"][0]["mountPath"]
    assert c["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "tok"
    # a fallback pod is in no Deployment: Ready only while it can serve (/readyz and the operator's gate); the
    # chart's pool pods are Ready when healthy (/healthz, available to their Deployment), serving by label
    docs = [d for d in yaml.safe_load_all(helm("template", "rel", str(CHART)).stdout) if d]
    chart_pool = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "rel-pool")
    chart_spec = chart_pool["spec"]["template"]["spec"]
    assert (
        pod["spec"]["readinessGates"] == [{"conditionType": "kascade.io/serving"}]
        and "readinessGates" not in chart_spec
    )
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert chart_spec["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["livenessProbe"]["httpGet"] == chart_spec["containers"][0]["livenessProbe"]["httpGet"]
    uri = spec.model_copy(update={"model": spec.model.model_copy(update={"source": spec.model.source.model_copy(
        update={"path": None, "uri": f"file://{ckpt}"})})})
    assert parse(fallback_pod(uri, "svc", "tok", None)["spec"]["containers"][0]["args"])["checkpoint"] == ckpt


def test_kind_e2e_values_and_modelservice_agree(helm: Helm) -> None:
    """e2e/kind/run.sh cannot run here (no Docker): at least its chart values render, and the pool it
    installs is started for exactly the model its ModelService asks for, from the same directory."""
    from kascade_operator.api import ModelServiceSpec

    kind = CHART.parents[1] / "e2e" / "kind"
    docs = [
        d
        for d in yaml.safe_load_all(helm("template", "kascade", str(CHART), "-f", str(kind / "values.yaml")).stdout)
        if d
    ]
    pool = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kascade-pool")
    c = pool["spec"]["template"]["spec"]["containers"][0]
    msvc = yaml.safe_load((kind / "modelservice.yaml").read_text())
    spec = ModelServiceSpec.model_validate(msvc["spec"])
    assert f"--model-name={spec.model.name}" in c["args"] and f"--checkpoint={spec.model.source.path}" in c["args"]
    assert c["image"] == spec.engine.image == "kascade:e2e" and c["imagePullPolicy"] == "Never"


def _render(helm: Helm, tmp: Path, values: dict[str, Any]) -> list[dict[str, Any]]:
    (tmp / "values.yaml").write_text(yaml.safe_dump(values))
    apis = [
        a
        for k in ("ServiceMonitor", "PodMonitor", "PrometheusRule")
        for a in ("--api-versions", f"monitoring.coreos.com/v1/{k}")
    ]
    return [
        d
        for d in yaml.safe_load_all(helm("template", "rel", str(CHART), "-f", str(tmp / "values.yaml"), *apis).stdout)
        if d
    ]


def _deployment(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The first container of Deployment `name`."""
    return next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == name)[
        "spec"]["template"]["spec"]["containers"][0]


def _operator_settings(docs: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> OperatorSettings:
    """The operator's settings as its rendered Deployment's literal env values set them."""
    for e in _deployment(docs, "rel-operator")["env"]:
        if "value" in e:
            monkeypatch.setenv(e["name"], e["value"])
    return OperatorSettings()


def test_pool_transport_reaches_pool_engines_fallback_pods_and_the_network_policy(
        helm: Helm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pool.transport: the pool's engines and the operator's fallback pods speak the same data-plane transport
    (the KV of disaggregated serving included); with ucx, UCX's own TCP listeners stay in pool.ucxTcpPorts,
    which the engines' NetworkPolicy admits from other engines. Unknown values and ucx with TLS are refused."""
    from pydantic import ValidationError

    from kascade_operator.api import ModelServiceSpec
    from kascade_operator.podtemplate import fallback_pod

    (tmp_path / "m1").mkdir()  # click checks the checkpoint directory exists, as it would in the pod
    spec = ModelServiceSpec.model_validate({"model": {"name": "m1", "source": {"path": str(tmp_path / "m1")}},
                                            "engine": {"image": "img:1"}, "mode": "colocated",
                                            "replicas": {"colocated": {"min": 1, "max": 2}}})
    model = {"name": "m1", "path": str(tmp_path / "m1"), "mountPath": str(tmp_path)}

    def engine_to_engine_ports(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        np = next(d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "rel-engines")
        return np["spec"]["ingress"][0]["ports"]

    for transport, ports in (("tcp", None), ("ucx", (18700, 18703))):
        values: dict[str, Any] = {"pool": {"transport": transport, "model": model}}
        if ports:
            values["pool"]["ucxTcpPorts"] = {"first": ports[0], "last": ports[1]}
        docs = _render(helm, tmp_path, values)
        pool = _deployment(docs, "rel-pool")
        assert parse(pool["args"])["transport"] == transport
        env = {e["name"]: e.get("value") for e in pool["env"]}
        rng = f"{ports[0]}-{ports[1]}" if ports else None
        assert env.get("UCX_TCP_PORT_RANGE") == rng
        ucx_rule = {"port": ports[0], "endPort": ports[1], "protocol": "TCP"} if ports else None
        assert (ucx_rule in engine_to_engine_ports(docs)) == bool(ports)
        assert all("endPort" not in p for p in engine_to_engine_ports(docs)) == (not ports)
        settings = _operator_settings(docs, monkeypatch)
        assert settings.engine_transport == transport and settings.engine_ucx_tcp_ports == (rng or "")
        fb = fallback_pod(spec, "svc", "tok", None, transport=settings.engine_transport,
                          ucx_tcp_ports=settings.engine_ucx_tcp_ports)["spec"]["containers"][0]
        assert parse(fb["args"])["transport"] == transport
        assert {e["name"]: e.get("value") for e in fb["env"]}.get("UCX_TCP_PORT_RANGE") == rng

    out = helm("template", "rel", str(CHART), "--set", "pool.transport=quic", check=False)
    assert out.returncode != 0 and "transport" in out.stderr, out.stderr
    out = helm("template", "rel", str(CHART), "--set", "pool.transport=ucx", "--set", "dataPlaneTls.secretName=tls",
               check=False)
    assert out.returncode != 0 and "TLS is TCP-only" in out.stderr, out.stderr
    out = helm("template", "rel", str(CHART), "--set", "pool.ucxTcpPorts.first=18600", check=False)
    assert out.returncode != 0 and "first 18600 is after last" in out.stderr, out.stderr
    monkeypatch.setenv("KASCADE_OPERATOR_ENGINE_TRANSPORT", "quic")
    with pytest.raises(ValidationError, match="engine_transport"):
        OperatorSettings()
    monkeypatch.setenv("KASCADE_OPERATOR_ENGINE_TRANSPORT", "ucx")
    monkeypatch.setenv("KASCADE_OPERATOR_ENGINE_TLS_SECRET", "tls")
    with pytest.raises(ValidationError, match="TLS is TCP-only"):
        OperatorSettings()


def test_pool_activation_dscp_reaches_pool_engines_and_fallback_pods(
        helm: Helm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pool.activationDscp: the pool's engines and the operator's fallback pods mark their activation
    connections with the same DSCP (engine --activation-dscp); unset, both get the engine's own default (AF41),
    0 turns the mark off, and a value outside [0, 63] is refused by the chart and by the operator's settings."""
    from pydantic import ValidationError

    from kascade_engine.net.transport import AF41
    from kascade_operator.api import ModelServiceSpec
    from kascade_operator.podtemplate import fallback_pod

    (tmp_path / "m1").mkdir()  # click checks the checkpoint directory exists, as it would in the pod
    spec = ModelServiceSpec.model_validate({"model": {"name": "m1", "source": {"path": str(tmp_path / "m1")}},
                                            "engine": {"image": "img:1"}, "mode": "colocated",
                                            "replicas": {"colocated": {"min": 1, "max": 2}}})
    model = {"name": "m1", "path": str(tmp_path / "m1"), "mountPath": str(tmp_path)}
    for dscp in (None, 46, 0):
        pool: dict[str, Any] = {"model": model, **({} if dscp is None else {"activationDscp": dscp})}
        docs = _render(helm, tmp_path, {"pool": pool})
        want = AF41 if dscp is None else dscp
        assert parse(_deployment(docs, "rel-pool")["args"])["activation_dscp"] == want
        settings = _operator_settings(docs, monkeypatch)
        assert settings.engine_activation_dscp == want
        fb = fallback_pod(spec, "svc", "tok", None, activation_dscp=settings.engine_activation_dscp)
        assert parse(fb["spec"]["containers"][0]["args"])["activation_dscp"] == want
    # a fallback pod built without the setting marks as the engine would by default
    assert parse(fallback_pod(spec, "svc", "tok", None)["spec"]["containers"][0]["args"])["activation_dscp"] == AF41

    for bad in ("64", "-1"):
        out = helm("template", "rel", str(CHART), "--set", f"pool.activationDscp={bad}", check=False)
        assert out.returncode != 0 and "activationDscp" in out.stderr, out.stderr
    monkeypatch.setenv("KASCADE_OPERATOR_ENGINE_ACTIVATION_DSCP", "64")
    with pytest.raises(ValidationError, match="engine_activation_dscp"):
        OperatorSettings()


def test_pool_host_cache_settings_reach_the_pool_engines_and_the_operator(
        helm: Helm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pool.hostCacheGiB is each pool engine's --host-cache-gib (the host copy's budget), and the operator's
    fallback pods' too; pool.hostCopiesPerModel the operator's host_copies_per_model (copies kept per model);
    defaults 16 and 1; out-of-range values refused."""
    from kascade_operator.api import ModelServiceSpec
    from kascade_operator.podtemplate import fallback_pod

    (tmp_path / "m1").mkdir()  # click checks the checkpoint directory exists, as it would in the pod
    model = {"name": "m1", "path": str(tmp_path / "m1"), "mountPath": str(tmp_path)}
    spec = ModelServiceSpec.model_validate({"model": {"name": "m1", "source": {"path": str(tmp_path / "m1")}},
                                            "engine": {"image": "img:1"}, "mode": "colocated",
                                            "replicas": {"colocated": {"min": 1, "max": 2}}})
    for pool, gib, copies in (({}, 16.0, 1), ({"hostCacheGiB": 2.5, "hostCopiesPerModel": 3}, 2.5, 3),
                              ({"hostCacheGiB": 0, "hostCopiesPerModel": 0}, 0.0, 0)):
        docs = _render(helm, tmp_path, {"pool": {"model": model, **pool}})
        assert parse(_deployment(docs, "rel-pool")["args"])["host_cache_gib"] == gib
        settings = _operator_settings(docs, monkeypatch)
        assert settings.host_copies_per_model == copies
        fb = fallback_pod(spec, "svc", "tok", None, host_cache_gib=settings.engine_host_cache_gib)
        assert parse(fb["spec"]["containers"][0]["args"])["host_cache_gib"] == gib  # a fallback pod keeps one too
    for bad in ("pool.hostCopiesPerModel=65", "pool.hostCacheGiB=-1"):
        out = helm("template", "rel", str(CHART), "--set", bad, check=False)
        assert out.returncode != 0 and bad.split("=")[0].split(".")[1] in out.stderr, out.stderr


def test_pool_node_cache_mounts_one_host_directory_and_counts_copies_per_node(
        helm: Helm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pool.nodeCache.enabled: each pool engine gets --node-cache-dir on a hostPath mount of pool.nodeCache.hostPath
    (the node's shared directory) and --node-cache-gib = budgetGiB, and the operator counts host copies per node
    (settings.node_cache); off (the default): no flag, no hostPath, copies per engine. Bad values are refused."""
    (tmp_path / "m1").mkdir()
    model = {"name": "m1", "path": str(tmp_path / "m1"), "mountPath": str(tmp_path)}
    docs = _render(helm, tmp_path, {"pool": {"model": model}})
    args = parse(_deployment(docs, "rel-pool")["args"])
    assert args["node_cache_dir"] is None and _operator_settings(docs, monkeypatch).node_cache is False
    docs = _render(helm, tmp_path, {"pool": {"model": model, "nodeCache": {"enabled": True, "budgetGiB": 3.5,
                                                                          "hostPath": "/dev/shm/kc"}}})
    c = _deployment(docs, "rel-pool")
    args = parse(c["args"])
    mount = next(m for m in c["volumeMounts"] if m["name"] == "node-cache")
    assert str(args["node_cache_dir"]) == mount["mountPath"] and args["node_cache_gib"] == 3.5
    pod = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "rel-pool")["spec"]["template"]
    vol = next(v for v in pod["spec"]["volumes"] if v["name"] == "node-cache")
    assert vol["hostPath"] == {"path": "/dev/shm/kc", "type": "DirectoryOrCreate"}
    assert _operator_settings(docs, monkeypatch).node_cache is True
    # the directory becomes pool.runAsUser's before the non-root engine starts (root with CHOWN, FOWNER only)
    uid = pod["spec"]["securityContext"]["runAsUser"]
    init = pod["spec"]["initContainers"][0]  # before the model download (the chart's default)
    assert [c["name"] for c in pod["spec"]["initContainers"]] == ["node-cache-owner", "model-download"]
    assert init["name"] == "node-cache-owner" and f"os.chown(d, {uid}, {uid})" in init["args"][-1]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert init["volumeMounts"] == [{"name": "node-cache", "mountPath": "/kascade/node-cache"}]
    docs = _render(helm, tmp_path, {"pool": {"model": model, "nodeCache": {"enabled": True, "setOwner": False}}})
    pod = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "rel-pool")["spec"]["template"]
    assert [c["name"] for c in pod["spec"]["initContainers"]] == ["model-download"]
    for bad in ("pool.nodeCache.budgetGiB=-1", "pool.nodeCache.hostPath=relative",
                "pool.extraArgs={--node-cache-dir=/x}", "pool.nodeCache.setOwner=maybe"):
        out = helm("template", "rel", str(CHART), "--set", f"pool.model.name=m,pool.model.path=/m,{bad}", check=False)
        assert out.returncode != 0 and ("nodeCache" in out.stderr or "node-cache" in out.stderr), (bad, out.stderr)


def test_fallback_pods_require_prefill_signatures_exactly_when_pool_engines_do(
        helm: Helm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """router.enabled and router.signPrefillPeers give the pool's engines --require-prefill-signature, and the
    operator's setting that gives its fallback pods the same flag: a fallback engine must not dial a peer a
    pool engine would refuse. Both sides' args parsed by the real CLI, for every combination."""
    from kascade_operator.api import ModelServiceSpec
    from kascade_operator.podtemplate import fallback_pod

    (tmp_path / "m1").mkdir()  # click checks the checkpoint directory exists, as it would in the pod
    model = {"name": "m1", "path": str(tmp_path / "m1"), "mountPath": str(tmp_path)}
    spec = ModelServiceSpec.model_validate({"model": {"name": "m1", "source": {"path": str(tmp_path / "m1")}},
                                            "engine": {"image": "img:1"}, "mode": "colocated",
                                            "replicas": {"colocated": {"min": 1, "max": 2}}})
    for enabled, sign in ((True, True), (True, False), (False, True)):
        docs = _render(helm, tmp_path, {"pool": {"model": model},
                                        "router": {"enabled": enabled, "signPrefillPeers": sign}})
        pool = parse(_deployment(docs, "rel-pool")["args"])["require_prefill_signature"]
        assert pool is (enabled and sign)
        settings = _operator_settings(docs, monkeypatch)
        assert settings.engine_require_prefill_signature is pool
        fb = fallback_pod(spec, "svc", "tok", None,
                          require_prefill_signature=settings.engine_require_prefill_signature)
        assert parse(fb["spec"]["containers"][0]["args"])["require_prefill_signature"] is pool, (enabled, sign)
