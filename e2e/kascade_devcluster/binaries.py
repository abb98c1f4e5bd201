"""Where the control-plane binaries are: $KASCADE_K8S_BIN or the cache link the build script makes."""

from __future__ import annotations

import os
from pathlib import Path

REQUIRED = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "kubectl", "helm")


class MissingBinaries(RuntimeError):
    pass


def cache_dir() -> Path:
    base = os.environ.get("KASCADE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kascade")
    return Path(base)


def bin_dir() -> Path:
    """The directory holding every binary in REQUIRED, or MissingBinaries naming what is absent."""
    d = Path(os.environ["KASCADE_K8S_BIN"]) if os.environ.get("KASCADE_K8S_BIN") else cache_dir() / "bin" / "current"
    missing = [b for b in REQUIRED if not (d / b).is_file()]
    if missing:
        raise MissingBinaries(
            f"control-plane binaries missing in {d}: {', '.join(missing)} "
            "(build them with `make install` or `bash hack/build-control-plane.sh`)"
        )
    return d.resolve()
