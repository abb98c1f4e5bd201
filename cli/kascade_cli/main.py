"""Entry point of the `kascade` command.

Data flow: argv -> click group -> a subcommand module loaded on demand from SUBCOMMANDS -> the
component's library code. Logging is configured here, once, and nowhere else.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging

import click

from kascade_cli import kascade_version, logsetup

# name -> ("module", "attribute", one-line help). A module that is not present yet is simply not
# listed, so components can land independently.
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "plan": ("kascade_cli.plan", "plan", "Plan a scale-up on a topology and compare algorithms."),
    "transfer": ("kascade_cli.transfer", "transfer", "Serve or receive weight blocks (data plane)."),
    "engine": ("kascade_cli.engine", "engine", "Run the inference engine."),
    "operator": ("kascade_cli.operator_cmd", "operator", "Run the Kubernetes operator."),
    "cluster": ("kascade_cli.cluster", "cluster", "Start or stop the local test control plane."),
    "demo": ("kascade_cli.demo", "demo", "Run the end-to-end demo on a local control plane."),
    "demo-kind": ("kascade_cli.demo", "demo_kind", "Run the demo in pods on a kind cluster built here."),
    "sim": ("kascade_cli.sim", "sim", "Simulate a cluster on a workload trace."),
    "router": ("kascade_cli.router", "router", "Run the OpenAI-compatible front door (routes by model)."),
    "probe": ("kascade_cli.probe", "probe", "Check a running endpoint (helm test)."),
    "model": ("kascade_cli.model_cmd", "model", "Fetch model checkpoints (pool init container)."),
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported only when they run (or when their help shows)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        present = [n for n, (mod, _, _) in SUBCOMMANDS.items() if importlib.util.find_spec(mod) is not None]
        return sorted([*super().list_commands(ctx), *present])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in SUBCOMMANDS:
            mod, attr, _ = SUBCOMMANDS[cmd_name]
            if importlib.util.find_spec(mod) is None:
                return None
            command = getattr(importlib.import_module(mod), attr)
            assert isinstance(command, click.Command)
            return command
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Short help comes from SUBCOMMANDS so listing never imports heavy modules.
        rows = []
        for name in self.list_commands(ctx):
            if name in SUBCOMMANDS:
                rows.append((name, SUBCOMMANDS[name][2]))
            else:
                cmd = super().get_command(ctx, name)
                rows.append((name, cmd.get_short_help_str() if cmd else ""))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@click.option("--log-format", type=click.Choice(logsetup.FORMATS), default="text", show_default=True,
              envvar="KASCADE_LOG_FORMAT", help="text, or one JSON object per line (operator, engine, router).")
def cli(verbose: int, log_format: logsetup.LogFormat) -> None:
    """Kascade: fast, live LLM autoscaling on Kubernetes."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logsetup.configure(level, log_format)


@cli.command()
def version() -> None:
    """Print the Kascade version."""
    click.echo(f"kascade {kascade_version()}")


if __name__ == "__main__":  # pragma: no cover
    cli()
