"""The `kascade` entry point: help, version, unknown commands."""

import subprocess
import sys

from click.testing import CliRunner

from kascade_cli import kascade_version
from kascade_cli.main import cli


def test_version_prints_distribution_version() -> None:
    result = CliRunner().invoke(cli, ["version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"kascade {kascade_version()}"
    assert kascade_version().count(".") >= 2


def test_help_lists_version_and_does_not_import_heavy_modules() -> None:
    code = (
        "import sys; from click.testing import CliRunner; from kascade_cli.main import cli;"
        "r = CliRunner().invoke(cli, ['--help']); print(r.output);"
        "print('HEAVY', [m for m in ('torch', 'kopf', 'ucxx') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "version" in out
    assert "HEAVY []" in out


def test_unknown_command_fails_with_clear_message() -> None:
    result = CliRunner().invoke(cli, ["no-such-command"])
    assert result.exit_code != 0
    assert "no-such-command" in result.output
