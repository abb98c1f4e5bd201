"""`kascade transfer`: run one participant of a weight transfer as a process, and pack checkpoints.

  kascade transfer pack CHECKPOINT_DIR CACHE_FILE      # safetensors -> host-cache file (+ manifest)
  kascade transfer run --spec SPEC.json --me ID [--cache FILE] [--out FILE] [--transport tcp|ucx]
                                [--tls-cert PEM --tls-key PEM --tls-ca PEM]
Sources serve blocks from --cache; targets write what they received to --out (host-cache format) and
print a JSON summary line. Used by the engine, the tests and the benchmark.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import click


@click.group()
def transfer() -> None:
    """Weight data plane: pack checkpoints, run transfer participants."""


@transfer.command()
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("cache_file", type=click.Path(dir_okay=False, path_type=Path))
def pack(checkpoint: Path, cache_file: Path) -> None:
    """Pack a safetensors Llama checkpoint into a memory-mappable host-cache file."""
    from kascade_engine.weights.blocks import CheckpointError, pack_checkpoint
    from kascade_engine.weights.hostcache import write_cache

    try:
        blocks = pack_checkpoint(checkpoint)
    except CheckpointError as e:
        raise click.ClickException(f"{checkpoint}: {e}") from None
    write_cache(cache_file, blocks)
    click.echo(json.dumps({"model": blocks.model, "blocks": len(blocks.blocks), "bytes": blocks.total_bytes,
                           "cache": str(cache_file)}))


@transfer.command()
@click.option("--spec", "spec_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--me", required=True, help="This participant's instance id in the plan.")
@click.option(
    "--cache", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="Blocks to serve (sources)."
)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Where a target writes its blocks.")
@click.option("--transport", "transport_name", type=click.Choice(["tcp", "ucx"]), default="tcp", show_default=True)
@click.option("--linger", type=float, default=0.0, help="Keep serving pulls this many seconds after finishing.")
@click.option(
    "--start-when", type=click.Path(dir_okay=False, path_type=Path),
    help="Listen at once, but start the plan (push; count the plan's timeout for a silent upstream) only once "
         "this file exists: a launcher of separate processes creates it when every participant listens.",
)
@click.option(
    "--tls-cert", type=click.Path(dir_okay=False, path_type=Path), help="PEM certificate (mutual TLS, tcp only)"
)
@click.option("--tls-key", type=click.Path(dir_okay=False, path_type=Path), help="PEM private key of --tls-cert")
@click.option(
    "--tls-ca", type=click.Path(dir_okay=False, path_type=Path), help="PEM CA every peer's certificate must chain to"
)
def run(
    spec_path: Path,
    me: str,
    cache: Path | None,
    out: Path | None,
    transport_name: str,
    linger: float,
    start_when: Path | None,
    tls_cert: Path | None,
    tls_key: Path | None,
    tls_ca: Path | None,
) -> None:
    """Run one participant until its part of the transfer is done."""
    from kascade_engine.net.recovery import TransferFailed
    from kascade_engine.net.relay import TransferNode
    from kascade_engine.net.transfer_spec import SpecError, TransferSpec
    from kascade_engine.net.transport_tls import TlsError, TlsFiles
    from kascade_engine.net.transports import make_transport
    from kascade_engine.weights.blocks import BlockSet, CheckpointError
    from kascade_engine.weights.hostcache import open_cache, write_cache

    try:
        transport = make_transport(transport_name, TlsFiles.from_flags(tls_cert, tls_key, tls_ca))
    except (TlsError, ValueError) as e:
        raise click.UsageError(str(e)) from None

    try:
        spec = TransferSpec.from_dict(json.loads(spec_path.read_text()))
    except (SpecError, json.JSONDecodeError) as e:
        raise click.ClickException(f"{spec_path}: {e}") from None
    ids = {i.id for i in (*spec.plan.sources, *spec.plan.targets)}
    if me not in ids:
        raise click.ClickException(f"--me {me!r} is not an instance of the plan ({', '.join(sorted(ids))})")
    try:
        blocks = open_cache(cache) if cache else None
    except (CheckpointError, OSError) as e:  # a damaged or unreadable cache: say so, not a traceback
        raise click.ClickException(f"--cache {cache}: {e}") from None
    if any(s.id == me for s in spec.plan.sources) and blocks is None:
        raise click.ClickException(f"{me} is a source: pass --cache")

    def progress(e: dict[str, object]) -> None:
        print(json.dumps(e), file=sys.stderr, flush=True)

    async def main() -> dict[str, object]:
        node = TransferNode(spec, me, transport, blocks, progress)
        port = await node.start()
        print(json.dumps({"event": "listening", "instance": me, "port": port}), file=sys.stderr, flush=True)
        try:
            # Participants started as processes come up seconds apart on a loaded machine (imports, UCX): a
            # target's timer for a silent upstream must not count its source's start-up.
            while start_when is not None and not start_when.exists():
                await asyncio.sleep(0.01)
            summary = await node.run()
            if linger:
                await asyncio.sleep(linger)
            if out and not node.is_source:
                write_cache(
                    out, BlockSet(spec.plan.model.name, {}, [node.resident[b] for b in spec.plan.model.block_ids])
                )
            return summary
        finally:
            await node.close()

    try:
        summary = asyncio.run(main())
    except TransferFailed as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(summary))
