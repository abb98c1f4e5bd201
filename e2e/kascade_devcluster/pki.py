"""Certificates and tokens for a local control plane, made with the openssl CLI.

Data flow: a directory -> CA, apiserver serving cert (SANs 127.0.0.1, localhost), service-account
key pair, and a static token file whose admin token is in system:masters. Nothing leaves the directory.
The CA and serving keys are ECDSA P-256 (instant to generate; RSA-2048 cost ~0.7 s each, a third of
start-up on 2 busy cores); the service-account key stays RSA, the algorithm every client expects.
"""

from __future__ import annotations

import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pki:
    dir: Path
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    sa_key: Path
    sa_pub: Path
    tokens_csv: Path
    admin_token: str


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args[:2])} failed: {proc.stderr.strip()}")


def make_pki(directory: Path, extra_tokens: dict[str, str] | None = None) -> Pki:
    """Create (or reuse) the PKI in `directory`. `extra_tokens` maps user name -> token."""
    d = directory
    d.mkdir(parents=True, exist_ok=True)
    p = Pki(d, d / "ca.crt", d / "ca.key", d / "apiserver.crt", d / "apiserver.key",
            d / "sa.key", d / "sa.pub", d / "tokens.csv", admin_token="")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1")
    if not p.ca_cert.exists():
        _openssl("req", "-x509", *ec, "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
                 "-days", "3650", "-subj", "/CN=kascade-local-ca", cwd=d)
    if not p.server_cert.exists():
        (d / "san.cnf").write_text(
            "[req]\ndistinguished_name=dn\n[dn]\n[ext]\n"
            "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default\n"
            "keyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n"
        )
        _openssl("req", *ec, "-nodes", "-keyout", "apiserver.key", "-out", "apiserver.csr",
                 "-subj", "/CN=kube-apiserver", cwd=d)
        _openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", "apiserver.crt", "-days", "3650", "-extfile", "san.cnf",
                 "-extensions", "ext", cwd=d)
    if not p.sa_key.exists():
        _openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
        _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)
    token_file = d / "admin.token"
    if not token_file.exists():
        token_file.write_text(secrets.token_hex(16))
        token_file.chmod(0o600)
    admin = token_file.read_text().strip()
    lines = [f'{admin},admin,admin-uid,"system:masters"']
    for i, (user, tok) in enumerate(sorted((extra_tokens or {}).items())):
        lines.append(f"{tok},{user},uid-{i}")
    p.tokens_csv.write_text("\n".join(lines) + "\n")
    p.tokens_csv.chmod(0o600)
    return Pki(**{**p.__dict__, "admin_token": admin})
