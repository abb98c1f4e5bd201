"""`kascade model download REPO --dest DIR`: put a checkpoint from the Hugging Face Hub where the engine
reads it (the chart's pool init container; also handy on a workstation).

Data flow: repo id + revision -> huggingface_hub.snapshot_download (only config, tokenizer and
safetensors files; $HF_TOKEN for gated repos; files already in DIR are kept) -> DIR -> a summary line.
"""

from __future__ import annotations

import logging
from pathlib import Path

import click

log = logging.getLogger(__name__)
# what `kascade engine serve --checkpoint` reads; no .bin/.pt/.gguf duplicates
PATTERNS = ("*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt")


@click.group("model")
def model() -> None:
    """Fetch model checkpoints."""


@model.command("download")
@click.argument("repo")
@click.option("--dest", required=True, type=click.Path(file_okay=False, path_type=Path), help="checkpoint directory")
@click.option("--revision", default="main", show_default=True, help="branch, tag or commit")
def download(repo: str, dest: Path, revision: str) -> None:
    """Download REPO's config, tokenizer and safetensors weights into --dest."""
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise click.BadParameter(f"{repo!r}: expected OWNER/NAME", param_hint="REPO")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    dest.mkdir(parents=True, exist_ok=True)
    log.info("downloading %s@%s into %s", repo, revision, dest)
    try:
        snapshot_download(repo_id=repo, revision=revision, local_dir=dest, allow_patterns=list(PATTERNS))
    except HfHubHTTPError as e:
        raise click.ClickException(f"{repo}@{revision}: {e}") from None
    files = [p for p in dest.rglob("*") if p.is_file() and ".cache" not in p.parts]
    if not any(p.suffix == ".safetensors" for p in files):
        raise click.ClickException(f"{repo}@{revision}: no .safetensors weights downloaded into {dest}")
    size = sum(p.stat().st_size for p in files)
    click.echo(f"{repo}@{revision}: {len(files)} files, {size / 2**20:.1f} MiB in {dest}")
