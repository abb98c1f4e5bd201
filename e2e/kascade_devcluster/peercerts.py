"""Data-plane test certificates (ECDSA P-256) made with the openssl CLI: a CA with a peer certificate it signed, and a
rogue CA
with one of its own (for mutual-TLS tests of the data plane; hack/install.sh installs openssl)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from kascade_devcluster.requirement import unavailable

EC = ("ec", "-pkeyopt", "ec_paramgen_curve:prime256v1")  # instant to generate, unlike RSA


def make_peer_certs(directory: Path) -> dict[str, Path]:
    """With the openssl CLI: a CA and a peer certificate it signed ("cert"/"key"/"ca"), and a rogue CA with
    a certificate of its own ("rogue_cert"/"rogue_key"/"rogue_ca"), all PEM files in `directory`."""
    if shutil.which("openssl") is None:
        unavailable("the openssl CLI (makes the test certificates)")
    directory.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}

    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    for prefix, name in (("", "kascade-test-ca"), ("rogue_", "rogue-ca")):
        ssl("req", "-x509", "-newkey", *EC, "-nodes", "-days", "2", "-subj", f"/CN={name}",
            "-keyout", f"{prefix}ca.key", "-out", f"{prefix}ca.pem")
        ssl("req", "-newkey", *EC, "-nodes", "-subj", "/CN=kascade-engine", "-keyout", f"{prefix}peer.key",
            "-out", f"{prefix}peer.csr")
        ssl("x509", "-req", "-in", f"{prefix}peer.csr", "-CA", f"{prefix}ca.pem", "-CAkey", f"{prefix}ca.key",
            "-CAcreateserial", "-days", "2", "-out", f"{prefix}peer.pem")
        out[f"{prefix}cert"], out[f"{prefix}key"] = directory / f"{prefix}peer.pem", directory / f"{prefix}peer.key"
        out[f"{prefix}ca"] = directory / f"{prefix}ca.pem"
    return out
