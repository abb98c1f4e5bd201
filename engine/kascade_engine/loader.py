"""Loading weights: by plan from peers (the control API's `load-plan` turned into a data-plane
`TransferNode` whose committed, hash-verified blocks become runnable model blocks the moment they
land), or the first copy from a checkpoint directory (`bind` with a `source.path`) or a model URI
(`source.uri`, `hf://`: downloaded first by modelsource.py).

Data flow (plan): `LoadPlanRequest` {plan, self, peers, planToken, manifest?} -> `TransferSpec` (the
data plane's wire type; a source uses its own manifest) -> `TransferNode.start()` listens on this
instance's data address -> `run()` receives/forwards -> on each committed block: `model.add_block`
(CPU: zero-copy views of the verified buffer, inline; CUDA: the host->device copy in a worker thread on the
model's upload stream, blocks in commit order, so the relay's event loop goes on forwarding chunks down the
chain meanwhile), bytesReceived updated -> all resident: phase serving, and the
received blocks become this engine's `blockset`, so it can be a source of the next plan.
Data flow (source): path (or uri -> `modelsource.resolve` -> snapshot dir) -> `pack_checkpoint` in a worker thread
(hashes every block) -> blocks
added in model order -> phase serving.
Data flow (node cache, --node-cache-dir: weights/nodecopy.py): a source load maps the node's copy of the model
instead of reading the source when the node has a valid one, else packs the source and publishes it as the
node's copy; a plan load publishes the landed blocks (or maps the node's copy of them) once the transfer is
over. Either way the engine's blockset (its chain-source buffers, its host copy) is the node's one mapped copy:
CPU weights are views of it, CUDA weights are uploaded from it, and no private host copy remains.
Data flow (host copy): a released engine's `host_copy` -> `bind` source.hostCopy adds its blocks again
(no disk, no network; the copy stays kept while the engine serves from it), or a plan naming this released
engine as a source sends from it (phase stays released: `host_feeding`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from pathlib import Path
from typing import Any, Protocol

from kascade_engine.batch import timeline
from kascade_engine.batch.model import LlamaModel
from kascade_engine.net.pacing import TokenBucket, paced
from kascade_engine.net.relay import TransferNode
from kascade_engine.net.transfer_spec import SpecError, TransferSpec
from kascade_engine.net.transport import Transport, TransportError
from kascade_engine.refusal import InstanceError
from kascade_engine.weights.blocks import BlockSet, CheckpointError
from kascade_engine.weights.nodecopy import NodeCopies, load_checkpoint, trim
from kascade_planner.engine_api import LoadPlanRequest

log = logging.getLogger(__name__)


class _LoadConfig(Protocol):
    @property
    def model_name(self) -> str: ...

    @property
    def tp(self) -> int: ...

    def weight_transport(self) -> Transport: ...


class LoadTarget(Protocol):
    """What loading reads and sets on its engine instance (EngineInstance is one): the model the blocks go into,
    the blocks it holds, and the load's own state (progress, errors, the running task). Read through the
    instance each time: a dtype rebuild at bind replaces its model."""

    blockset: BlockSet | None  # a complete copy held here (sources send from it)
    host_copy: BlockSet | None  # a copy kept in host memory after release
    host_feeding: bool
    bytes_received: int
    transfer_bw: float
    transfer_failures: int
    load_error: str | None
    loading: asyncio.Task[None] | None
    plan: dict[str, Any] | None
    instance_id: str
    node: NodeCopies | None  # the node cache (--node-cache-dir), or None


    @property
    def config(self) -> _LoadConfig: ...

    @property
    def model(self) -> LlamaModel: ...

    @property
    def egress(self) -> TokenBucket | None: ...

    @property
    def busy_loading(self) -> bool: ...

    def add_block(self, block: Any | None) -> None: ...  # None: already added (an upload off the loop)

    def begin_loading(self) -> None: ...


def _fail(status: int, message: str, field: str | None = None) -> Exception:
    return InstanceError(status, message, field)


def _running(inst: LoadTarget, req: LoadPlanRequest) -> bool:
    """Whether the plan running here is `req`'s (the same plan's secret token, this engine the same participant)."""
    held = str((inst.plan or {}).get("token") or "")
    return bool(held) and hmac.compare_digest(held, req.plan_token) and inst.instance_id == req.self_id


async def start_plan_load(inst: LoadTarget, req: LoadPlanRequest) -> None:
    """Take part in `req`'s plan. Asked again for the plan already running here, a no-op (idempotent); a
    different plan while one runs is refused (409)."""
    me = req.self_id
    target = any(t.get("id", t.get("instance")) == me for t in req.plan.get("targets") or ()
                 if isinstance(t, dict))
    # a released engine's host copy feeds plans it is a source of (it never becomes its own target's copy)
    blocks = inst.blockset if inst.blockset is not None or target else inst.host_copy
    manifest = req.manifest or (blocks.manifest() if blocks is not None else None)
    if manifest is None and inst.config.tp > 1:  # a TP instance loaded by slices holds no whole blocks: its manifest
        manifest = getattr(inst, "tp_whole_manifest", None)
    if manifest is None:
        raise _fail(400, "invalid field 'manifest': a loading target needs the block manifest", "manifest")
    if inst.busy_loading:
        if _running(inst, req):  # the operator asking again (a restart, a lost answer): it runs already
            return
        raise _fail(409, "a load plan is already running on this engine (another plan: wait for it or pick "
                         "another source)", "plan")
    doc = {"plan": dict(req.plan), "manifest": dict(manifest), "peers": dict(req.peers), "token": req.plan_token,
           "chunkBytes": req.chunk_bytes, "timeoutSeconds": req.timeout_seconds}
    try:
        spec = TransferSpec.from_dict(doc)
    except (SpecError, ValueError, TypeError) as e:
        raise _fail(400, f"invalid load plan: {e}", "plan") from None
    name = inst.config.model_name
    if spec.plan.model.name != name:
        raise _fail(409, f"plan is for model '{spec.plan.model.name}', this engine serves '{name}'", "plan.model")
    involved = {i.id for i in (*spec.plan.sources, *spec.plan.targets)}
    if me not in involved:
        raise _fail(400, f"invalid field 'self': '{me}' is not a source or target of this plan", "self")
    from kascade_engine.tp.planload import PlanRefused, plane_width, start_tp_plan

    g = plane_width(spec)
    if g > 1:  # targets are tensor-parallel: every rank receives its own plane (tp/planload.py)
        source = blocks if blocks is not None and (inst.model.complete or blocks is inst.host_copy) else None
        try:
            await start_tp_plan(inst, spec, me, g, target, source)
        except PlanRefused as e:
            raise _fail(e.status, str(e), e.field) from None
        return
    model = inst.model
    started = time.monotonic()

    last: asyncio.Task[None] | None = None  # CUDA: the newest block's upload (blocks land in commit order)

    def on_progress(event: dict[str, Any]) -> None:
        nonlocal last
        if event.get("event") != "block":
            return
        blk = node.resident[event["block"]]
        inst.bytes_received = int(event.get("bytes", inst.bytes_received))
        inst.transfer_bw = inst.bytes_received / max(1e-6, time.monotonic() - started)
        if model.device.type == "cuda":  # the host->device copy off this (the relay's) loop, in commit order
            last = asyncio.get_running_loop().create_task(upload(blk, event, last))
            return
        inst.add_block(blk)  # CPU: zero-copy views, microseconds
        landed(blk, event)

    async def upload(blk: Any, event: dict[str, Any], prev: asyncio.Task[None] | None) -> None:
        if prev is not None:
            await prev  # a failed earlier upload fails this one too: the load fails, visible in status
        await asyncio.to_thread(model.add_block, blk.id, blk.tensors())  # side stream; the loop forwards meanwhile
        inst.add_block(None)  # uploaded: the phase follows residency
        landed(blk, event)

    def landed(blk: Any, event: dict[str, Any]) -> None:
        timeline.mark("block", blk.id, resident=event.get("resident"), of=event.get("total"), bytes=inst.bytes_received)
        if model.complete and inst.blockset is None:
            inst.blockset = BlockSet(name, model.cfg, (node.resident[b] for b in spec.plan.model.block_ids))
            if inst.host_copy is not None and not host_source:  # the copy kept from before: one copy, not two
                inst.host_copy = inst.blockset
            log.info("%s: all %d blocks resident", me, event.get("total"))

    # only a released engine feeds from its host copy alone: a serving one's blockset may BE its kept copy
    host_source = blocks is not None and blocks is inst.host_copy and inst.blockset is None
    try:
        source = blocks if blocks is not None and (model.complete or host_source) else None
        node = TransferNode(spec, me, paced(inst.config.weight_transport(), inst.egress),
                            blocks=source, on_progress=on_progress)
        await node.start()
    except (ValueError, TransportError) as e:
        inst.transfer_failures += 1
        raise _fail(400, f"cannot start the transfer: {e}", "peers") from None
    inst.instance_id = me
    inst.plan = doc
    inst.host_feeding = host_source

    async def run() -> None:
        done = False
        try:
            summary = await node.run()
            if last is not None:
                await last  # the last blocks' uploads (CUDA)
            log.info("transfer done: %s", summary)
            done = True
        except Exception as e:  # a failed transfer leaves the engine loading, visible in status
            log.error("transfer failed on %s: %s", me, e)
            inst.load_error = str(e)
            inst.transfer_failures += 1
        finally:
            inst.host_feeding = False
            await node.close()
        shared = done and target and inst.node is not None and inst.blockset is not None
        if shared and inst.node is not None and await share_landed(inst, inst.node):
            # the closed node's references are the last to the received buffers (anonymous regions, freed with
            # their last view): the engine's copy is the node's now
            node.resident.clear()
            node.buffers.clear()

    inst.loading = asyncio.create_task(run())
    if host_source:
        log.info("%s: feeding plan %s from the host copy", me, spec.plan.model.name)
    else:
        inst.begin_loading()


async def share_landed(inst: LoadTarget, node: NodeCopies) -> bool:
    """After a plan load: the landed blocks become the node's copy (or the node's copy of the same blocks is
    mapped), and the engine drops its private received buffers: CPU weights become views of the node's copy (the
    same bytes: the digests matched), CUDA weights stay on the device and only the host blocks are swapped.
    False when the engine keeps its private copy (the node cannot hold it: share logged why)."""
    private = inst.blockset
    assert private is not None
    if node.lease is not None and private is node.lease.blocks:
        return False  # already the node's copy (a source of the plan, or loaded from it)
    shared = await asyncio.to_thread(node.share, private)
    if shared is private:
        return False
    model = inst.model
    if model.device.type == "cpu":
        for b in shared.blocks.values():
            model.add_block(b.id, b.tensors())
    inst.blockset = shared
    if inst.host_copy is private:
        inst.host_copy = shared
    del private
    trim()
    return True


async def start_node_copy_load(inst: LoadTarget) -> None:
    """Bind with source.nodeCopy: the copy of the model the node cache holds (another engine of the node published
    it) is mapped read-only, every block's digest verified and the copy checked against this engine's model
    (`NodeCopies.find`), then uploaded like a host copy (`start_host_load`): no disk, no network, no data port.
    A 409 naming the field when the node holds no usable copy (the operator then plans the target by transfer)."""
    node = inst.node
    if node is None:
        raise _fail(409, "source.nodeCopy: this engine has no node cache (--node-cache-dir)", "source.nodeCopy")
    if inst.busy_loading:
        raise _fail(409, "a load is already running on this engine", "source")
    found = await asyncio.to_thread(node.find, inst.config.model_name, dict(inst.model.cfg), None)
    if found is None:
        raise _fail(409, f"source.nodeCopy: the node cache holds no usable copy of {inst.config.model_name} "
                    f"(see the engine log)", "source.nodeCopy")
    await start_host_load(inst, found, "the node's copy")


async def start_host_load(inst: LoadTarget, blocks: Any = None, what: str = "its host copy") -> None:
    """Bind with source.hostCopy (or, with `blocks`, source.nodeCopy): the blocks the engine kept in host memory at
    its last release (or `blocks`) become its model again (CPU: zero-copy views; CUDA: one host-to-device copy per
    block), in model order, yielding to the event loop between blocks. The copy is this engine's blockset (a
    source) once all are resident; a kept host copy stays the engine's host copy while it serves (status
    hostCopyBytes): zero extra bytes, since a serving engine keeps its blockset in host memory anyway."""
    blocks = inst.host_copy if blocks is None else blocks
    if blocks is None:
        raise _fail(409, "source.hostCopy: this engine keeps no host copy", "source.hostCopy")
    if inst.busy_loading:
        raise _fail(409, "a load is already running on this engine", "source")
    inst.load_error = None

    async def run() -> None:
        started = time.monotonic()
        for b in blocks.blocks.values():
            inst.bytes_received += b.nbytes
            if inst.model.device.type == "cuda":  # the host->device copy off the loop (upload stream)
                await asyncio.to_thread(inst.model.add_block, b.id, b.tensors())
                inst.add_block(None)
            else:
                inst.add_block(b)
                await asyncio.sleep(0)
        # serving again, and the copy stays a host copy (issue 18: never zero while the service exists): the
        # blockset a source sends from IS the kept copy, so it costs nothing more. CPU: the model's weights are
        # views of these buffers; CUDA: the weights are device tensors and these stay in host memory beside them
        inst.blockset = blocks
        inst.transfer_bw = blocks.total_bytes / max(1e-6, time.monotonic() - started)
        log.info("loaded %s from %s: %d blocks, %.1f MB in %.3f s", inst.config.model_name, what,
                 len(blocks.blocks), blocks.total_bytes / 1e6, time.monotonic() - started)

    inst.loading = asyncio.create_task(run())
    inst.begin_loading()


async def start_source_load(inst: LoadTarget, path: str | None = None, uri: str | None = None) -> None:
    """Load the first copy from a checkpoint directory (a volume the pod mounts) or a model URI
    (`hf://`: downloaded first, modelsource.py), in the background. Both end in `pack_checkpoint`."""
    from kascade_engine.weights.modelsource import SourceError, parse_uri, resolve

    if uri is not None:
        try:
            parse_uri(uri)
        except SourceError as e:
            raise _fail(400, f"invalid field 'source.uri': {e}", "source.uri") from None
        where = uri
    else:
        assert path is not None
        where = path
        if not (Path(path) / "config.json").is_file():
            raise _fail(400, f"invalid field 'source.path': {path} is not a checkpoint directory (no config.json)",
                        "source.path")
    if inst.busy_loading:
        raise _fail(409, "a load is already running on this engine", "source")
    model = inst.model
    inst.load_error = None

    async def run() -> None:
        started = time.monotonic()
        try:
            d = Path(where) if uri is None else await asyncio.to_thread(resolve, uri)
            if uri is not None and not (d / "config.json").is_file():
                raise CheckpointError(f"{d} is not a checkpoint directory (no config.json)")
            from kascade_engine.tp.planload import followers_load_path

            followers_load_path(inst, d)  # a tensor-parallel engine's other ranks pack it alongside (tp/rank.py)
            # the node's copy when it has one (--node-cache-dir), else packed from d (and published as the node's)
            blocks = await asyncio.to_thread(load_checkpoint, inst.node, d, inst.config.model_name)
            if blocks.config.get("num_hidden_layers") != model.shape.layers:
                raise CheckpointError(f"{where}: {blocks.config.get('num_hidden_layers')} layers, this engine "
                                      f"was started for {model.shape.layers}")
            for b in blocks.blocks.values():  # model order: embed, layers, head
                inst.bytes_received += b.nbytes
                inst.add_block(b)
            inst.blockset = blocks
            inst.transfer_bw = blocks.total_bytes / max(1e-6, time.monotonic() - started)
            log.info("loaded %s from %s: %d blocks, %.1f MB in %.2f s", inst.config.model_name, where,
                     len(blocks.blocks), blocks.total_bytes / 1e6, time.monotonic() - started)
        except SourceError as e:  # the operator shows this verbatim: name the field it came from
            log.error("loading %s from %s failed: %s", inst.config.model_name, where, e)
            inst.load_error = f"source.uri (spec.model.source.uri): {e}"
        except (CheckpointError, OSError, ValueError) as e:
            log.error("loading %s from %s failed: %s", inst.config.model_name, where, e)
            inst.load_error = f"source {where}: {e}"

    inst.loading = asyncio.create_task(run())
    inst.begin_loading()
