"""Install Kascade's CRDs (from the repo's crds/) into a control plane and wait until Established."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kascade_devcluster.controlplane import ControlPlane

REPO = Path(__file__).resolve().parents[2]
CRD_DIR = REPO / "crds"


def install_crds(cp: ControlPlane, crd_dir: Path = CRD_DIR, timeout_s: int = 60) -> list[str]:
    files = sorted(crd_dir.glob("*.yaml"))
    if not files:
        raise FileNotFoundError(f"no CRD files in {crd_dir}")
    cp.kubectl("apply", "--server-side", "--force-conflicts", *[a for f in files for a in ("-f", str(f))])
    names = cp.kubectl("get", "crd", "-o", "name", "-l", "app.kubernetes.io/part-of=kascade").stdout.split()
    cp.kubectl("wait", "--for=condition=Established", *names, f"--timeout={timeout_s}s")
    return [n.split("/", 1)[1] for n in names]
