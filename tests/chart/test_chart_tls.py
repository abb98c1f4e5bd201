"""Data-plane TLS in the chart: what the rendered containers run with `dataPlaneTls.secretName` is what the code
accepts (the real `kascade` CLI parses their args, the operator's environment builds its real settings), and every
client of an engine's HTTPS port is told the CA where the Secret is mounted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from test_chart_commands import CHART, Helm, _deployment, _operator_settings, _render, containers, parse


def test_data_plane_tls_secret_reaches_pool_and_fallback_engines_alike(helm: Helm, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """dataPlaneTls.secretName: the pool mounts the Secret and its engines' TLS flags read its keys; the
    operator is told the name and its fallback pods mount it at the same place with the same flags; the
    engine builds its TLS transport from files named as the Secret's keys (what the kubelet projects)."""
    from kascade_devcluster.peercerts import make_peer_certs
    from kascade_engine.net.transport_tls import TlsError, TlsFiles
    from kascade_engine.net.transports import make_transport
    from kascade_operator.api import ModelServiceSpec
    from kascade_operator.podtemplate import fallback_pod

    off = containers(helm, tmp_path, {})
    assert not [a for a in off["rel-pool"]["args"] if a.startswith("--tls")]
    assert (
        next(e for e in off["rel-operator"]["env"] if e["name"] == "KASCADE_OPERATOR_ENGINE_TLS_SECRET")["value"] == ""
    )
    (tmp_path / "m1").mkdir()  # click checks the checkpoint directory exists, as it would in the pod
    (tmp_path / "v.yaml").write_text(yaml.safe_dump({"dataPlaneTls": {"secretName": "engine-tls"}, "pool": {
        "model": {"name": "m1", "path": str(tmp_path / "m1"), "mountPath": str(tmp_path)}}}))
    docs = [d for d in yaml.safe_load_all(helm("template", "rel", str(CHART), "-f", str(tmp_path / "v.yaml")).stdout)
            if d]
    deps = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in docs if d["kind"] == "Deployment"}
    pool = deps["rel-pool"]
    vol = next(v for v in pool["volumes"] if "secret" in v)
    assert vol["secret"] == {"secretName": "engine-tls"}
    engine = pool["containers"][0]
    mount = next(m for m in engine["volumeMounts"] if m["name"] == vol["name"])
    assert mount["readOnly"] is True
    params = parse(engine["args"])
    flags = {k: params[f"tls_{k}"] for k in ("cert", "key", "ca")}
    assert flags == {"cert": Path(mount["mountPath"]) / "tls.crt", "key": Path(mount["mountPath"]) / "tls.key",
                     "ca": Path(mount["mountPath"]) / "ca.crt"}
    settings = _operator_settings(docs, monkeypatch)
    assert settings.engine_tls_secret == "engine-tls"
    spec = ModelServiceSpec.model_validate({"model": {"name": "m", "source": {"pvc": {"claimName": "models"}}},
                                            "engine": {"image": "img:1"}, "mode": "colocated",
                                            "replicas": {"colocated": {"min": 1, "max": 2}}})
    pod = fallback_pod(spec, "svc", "tok", None, tls_secret=settings.engine_tls_secret,
                       run_as_user=settings.engine_run_as_user)
    fb = pod["spec"]["containers"][0]
    # the pool's security context, uid included (pool.runAsUser -> KASCADE_OPERATOR_ENGINE_RUN_AS_USER)
    assert pod["spec"]["securityContext"] == pool["securityContext"] and settings.engine_run_as_user == 65532
    assert fb["securityContext"] == engine["securityContext"]
    fb_vol = next(v for v in pod["spec"]["volumes"] if "secret" in v)
    assert fb_vol["secret"] == vol["secret"]
    assert next(m for m in fb["volumeMounts"] if m["name"] == fb_vol["name"])["mountPath"] == mount["mountPath"]
    assert [a for a in fb["args"] if a.startswith("--tls-")] == [a for a in engine["args"] if a.startswith("--tls-")]
    assert not [a for a in fallback_pod(spec, "svc", "tok", None)["spec"]["containers"][0]["args"] if "tls" in a]

    # the Secret as the kubelet projects it (one file per key) is what the engine's TLS transport reads
    made = make_peer_certs(tmp_path / "pki")
    secret_dir = tmp_path / "secret"
    secret_dir.mkdir()
    for key, src in (("tls.crt", made["cert"]), ("tls.key", made["key"]), ("ca.crt", made["ca"])):
        (secret_dir / key).write_bytes(src.read_bytes())
    local = {k: secret_dir / v.name for k, v in flags.items()}
    files = TlsFiles.from_flags(local["cert"], local["key"], local["ca"])
    assert files is not None and make_transport("tcp", files).name == "tcp+tls"
    (secret_dir / "ca.crt").unlink()  # a Secret without ca.crt: the engine refuses to start, naming the flag
    with pytest.raises(TlsError, match="--tls-ca"):
        make_transport("tcp", files)


def _engine_ca(spec: dict[str, Any], container: dict[str, Any]) -> Path:
    """Where `container` sees the dataPlaneTls Secret's ca.crt (and only that key of it)."""
    vol = next(v for v in spec["volumes"] if v.get("secret", {}).get("secretName") == "engine-tls")
    assert vol["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]  # no private key in clients
    mount = next(m for m in container["volumeMounts"] if m["name"] == vol["name"])
    assert mount["readOnly"] is True
    return Path(mount["mountPath"]) / "ca.crt"


def test_data_plane_tls_makes_the_engines_http_port_https_for_probes_and_every_client(
        helm: Helm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """dataPlaneTls.secretName: engines serve HTTPS, so pool and fallback probes use scheme HTTPS; the
    operator (KASCADE_OPERATOR_ENGINE_CA_FILE), the router (--engine-ca) and the helm test without a router
    (--ca) read the Secret's ca.crt where it is mounted; the engines' PodMonitor scrapes over https."""
    from kascade_operator.api import ModelServiceSpec
    from kascade_operator.podtemplate import fallback_pod

    mon = {"podMonitor": {"enabled": True}}
    plain = _render(helm, tmp_path, {"monitoring": mon})
    pool = _deployment(plain, "rel-pool")
    assert {pool[p]["httpGet"].get("scheme", "HTTP") for p in ("readinessProbe", "livenessProbe", "startupProbe")} == {
        "HTTP"
    }
    pm = next(d for d in plain if d["kind"] == "PodMonitor")["spec"]["podMetricsEndpoints"][0]
    assert "scheme" not in pm and "tlsConfig" not in pm
    op = _deployment(plain, "rel-operator")
    assert "KASCADE_OPERATOR_ENGINE_CA_FILE" not in {e["name"] for e in op["env"]}
    router = _deployment(plain, "rel-router")
    assert parse(router["args"])["engine_ca"] is None

    docs = _render(helm, tmp_path, {"dataPlaneTls": {"secretName": "engine-tls"}, "monitoring": mon})
    specs = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in docs if d["kind"] == "Deployment"}
    pool = specs["rel-pool"]["containers"][0]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert pool[probe]["httpGet"]["scheme"] == "HTTPS", probe
    # the operator: its settings name the CA file where the Secret's ca.crt is mounted
    op = specs["rel-operator"]["containers"][0]
    settings = _operator_settings(docs, monkeypatch)
    assert Path(settings.engine_ca_file) == _engine_ca(specs["rel-operator"], op)
    # the router: --engine-ca as the real CLI parses it
    router = specs["rel-router"]["containers"][0]
    assert Path(parse(router["args"])["engine_ca"]) == _engine_ca(specs["rel-router"], router)
    # the fallback pods the operator creates probe like the pool's
    spec = ModelServiceSpec.model_validate({"model": {"name": "m", "source": {"pvc": {"claimName": "models"}}},
                                            "engine": {"image": "img:1"}, "mode": "colocated",
                                            "replicas": {"colocated": {"min": 1, "max": 2}}})
    fb = fallback_pod(spec, "svc", "tok", None, tls_secret=settings.engine_tls_secret)["spec"]["containers"][0]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):  # same scheme and port; readiness path
        assert {k: v for k, v in fb[probe]["httpGet"].items() if k != "path"} == \
            {k: v for k, v in pool[probe]["httpGet"].items() if k != "path"}, probe  # differs (fallback: /readyz)
    fb_plain = fallback_pod(spec, "svc", "tok", None)["spec"]["containers"][0]
    assert "scheme" not in fb_plain["readinessProbe"]["httpGet"]
    # Prometheus: https with the Secret's CA; no name to check unless serverName says one
    pm = next(d for d in docs if d["kind"] == "PodMonitor")["spec"]["podMetricsEndpoints"][0]
    assert pm["scheme"] == "https" and pm["tlsConfig"] == {"ca": {"secret": {"name": "engine-tls", "key": "ca.crt"}},
                                                           "insecureSkipVerify": True}
    named = _render(helm, tmp_path, {"dataPlaneTls": {"secretName": "engine-tls", "serverName": "engine.kascade"},
                                     "monitoring": mon})
    pm = next(d for d in named if d["kind"] == "PodMonitor")["spec"]["podMetricsEndpoints"][0]
    assert pm["tlsConfig"] == {
        "ca": {"secret": {"name": "engine-tls", "key": "ca.crt"}},
        "serverName": "engine.kascade",
    }

    # no router: the helm test asks the engines Service itself, over https with the CA
    docs = _render(helm, tmp_path, {"dataPlaneTls": {"secretName": "engine-tls"}, "router": {"enabled": False},
                                    "tests": {"enabled": True}})
    test = next(d for d in docs if d["kind"] == "Pod" and d["metadata"]["name"] == "rel-test-models")
    c = test["spec"]["containers"][0]
    params = parse(c["args"])
    assert params["url"].startswith("https://rel-engines.") and Path(params["ca"]) == _engine_ca(test["spec"], c)
    op = _deployment(docs, "rel-operator")
    assert "KASCADE_OPERATOR_ENGINE_CA_FILE" in {e["name"] for e in op["env"]}  # scrapes and calls still https
