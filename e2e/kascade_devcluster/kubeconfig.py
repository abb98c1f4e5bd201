"""Kubeconfig text for a local control plane (token auth, CA-verified TLS)."""

from __future__ import annotations

from pathlib import Path

import yaml


def kubeconfig_text(server: str, ca_cert: Path, token: str, user: str = "admin") -> str:
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kascade-local", "cluster": {"server": server, "certificate-authority": str(ca_cert)}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "kascade-local", "context": {"cluster": "kascade-local", "user": user}}],
        "current-context": "kascade-local",
    }
    return yaml.safe_dump(cfg, sort_keys=False)
