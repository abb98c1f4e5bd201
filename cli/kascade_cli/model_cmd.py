"""`kascade model download REPO --dest DIR`: put a checkpoint from the Hugging Face Hub where the engine
reads it (the chart's pool init container; also handy on a workstation).

Data flow: repo id + revision -> huggingface_hub.snapshot_download (only config, tokenizer and
safetensors files, or with --config-only no weights; $HF_ENDPOINT for a mirror, $HF_TOKEN for gated repos; files
already in DIR are kept) -> DIR -> a summary line.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import click

log = logging.getLogger(__name__)
# what `kascade engine serve --checkpoint` reads; no .bin/.pt/.gguf duplicates
PATTERNS = ("*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt")
CONFIG_PATTERNS = tuple(p for p in PATTERNS if p != "*.safetensors")  # what an empty engine starts with


@click.group("model")
def model() -> None:
    """Fetch model checkpoints."""


@model.command("download")
@click.argument("repo")
@click.option("--dest", required=True, type=click.Path(file_okay=False, path_type=Path), help="checkpoint directory")
@click.option("--revision", default="main", show_default=True, help="branch, tag or commit")
@click.option(
    "--config-only",
    is_flag=True,
    help="no weights: config and tokenizer (for `engine serve --empty`; "
    "the engine downloads the weights itself when bound to an hf:// source)",
)
def download(repo: str, dest: Path, revision: str, config_only: bool) -> None:
    """Download REPO's config, tokenizer and safetensors weights into --dest."""
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise click.BadParameter(f"{repo!r}: expected OWNER/NAME", param_hint="REPO")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    dest.mkdir(parents=True, exist_ok=True)
    log.info("downloading %s@%s into %s", repo, revision, dest)
    try:
        snapshot_download(
            repo_id=repo,
            revision=revision,
            local_dir=dest,
            allow_patterns=list(CONFIG_PATTERNS if config_only else PATTERNS),
            endpoint=os.environ.get("HF_ENDPOINT") or None,
        )  # read now, not at import
    except HfHubHTTPError as e:
        raise click.ClickException(f"{repo}@{revision}: {e}") from None
    except LocalEntryNotFoundError as e:  # the Hub did not answer (and nothing was downloaded before)
        hub = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
        cause = f"{type(e.__cause__).__name__}: {e.__cause__}" if e.__cause__ else str(e).splitlines()[0]
        raise click.ClickException(f"{repo}@{revision}: the Hub at {hub} did not answer ({cause}); check "
                                   "HF_ENDPOINT (chart: pool.model.download.endpoint) and the pod's egress") from None
    files = [p for p in dest.rglob("*") if p.is_file() and ".cache" not in p.parts]
    if not config_only and not any(p.suffix == ".safetensors" for p in files):
        raise click.ClickException(f"{repo}@{revision}: no .safetensors weights downloaded into {dest}")
    size = sum(p.stat().st_size for p in files)
    click.echo(f"{repo}@{revision}: {len(files)} files, {size / 2**20:.1f} MiB in {dest}")
