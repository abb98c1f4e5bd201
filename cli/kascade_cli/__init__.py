"""The `kascade` command line: one lazy click group per component.

Subcommands are imported only when invoked, so `kascade --help` works without torch, kopf or ucxx
installed and never pays their import time.
"""

from importlib.metadata import PackageNotFoundError, version


def kascade_version() -> str:
    """The installed distribution's version, or a dev marker when running from a bare checkout."""
    try:
        return version("kascade")
    except PackageNotFoundError:
        return "0.0.0+dev"
