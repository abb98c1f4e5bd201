"""Loading weights: by plan from peers (the control API's `load-plan` turned into a data-plane
`TransferNode` whose committed, hash-verified blocks become runnable model blocks the moment they
land), or the first copy from a checkpoint directory (`bind` with a `source.path`).

Data flow (plan): load-plan body {plan, self, peers, planToken, manifest?} -> `TransferSpec` (the
data plane's wire type; a source uses its own manifest) -> `TransferNode.start()` listens on this
instance's data address -> `run()` receives/forwards -> on each committed block: `model.add_block`
(zero-copy views of the verified buffer), bytesReceived updated -> all resident: phase ready, and the
received blocks become this engine's `blockset`, so it can be a source of the next plan.
Data flow (source): path -> `pack_checkpoint` in a worker thread (hashes every block) -> blocks
added in model order -> phase ready.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from kascade_engine.blocks import BlockSet, CheckpointError, pack_checkpoint
from kascade_engine.pacing import paced
from kascade_engine.relay import TransferNode
from kascade_engine.transfer_spec import SpecError, TransferSpec
from kascade_engine.transport import TransportError, make_transport

log = logging.getLogger(__name__)


class PlanLoadError(ValueError):
    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.field = status, field


async def start_loading(st: Any, body: dict[str, Any]) -> None:
    me = str(body["self"])
    blocks = st.blockset
    manifest = body.get("manifest") or (blocks.manifest() if blocks is not None else None)
    if manifest is None:
        raise PlanLoadError(400, "invalid field 'manifest': a loading target needs the block manifest", "manifest")
    if st.loading is not None and not st.loading.done():
        raise PlanLoadError(409, "a load plan is already running on this engine", "plan")
    doc = {"plan": body["plan"], "manifest": manifest, "peers": body["peers"], "token": body["planToken"],
           "chunkBytes": body["chunkBytes"], "timeoutSeconds": body["timeoutSeconds"]}
    try:
        spec = TransferSpec.from_dict(doc)
    except (SpecError, ValueError, TypeError) as e:
        raise PlanLoadError(400, f"invalid load plan: {e}", "plan") from None
    if spec.plan.model.name != st.model_name:
        raise PlanLoadError(409, f"plan is for model '{spec.plan.model.name}', this engine serves '{st.model_name}'", "plan.model")
    involved = {i.id for i in (*spec.plan.sources, *spec.plan.targets)}
    if me not in involved:
        raise PlanLoadError(400, f"invalid field 'self': '{me}' is not a source or target of this plan", "self")
    model = st.engine.model
    started = time.monotonic()

    def on_progress(event: dict[str, Any]) -> None:
        if event.get("event") != "block":
            return
        blk = node.resident[event["block"]]
        model.add_block(blk.id, blk.tensors())
        st.bytes_received = int(event.get("bytes", st.bytes_received))
        st.transfer_bw = st.bytes_received / max(1e-6, time.monotonic() - started)
        if model.complete and st.blockset is None:
            st.blockset = BlockSet(st.model_name, model.cfg, (node.resident[b] for b in spec.plan.model.block_ids))
        if model.complete and st.phase == "loading":
            st.phase = "ready"
            log.info("%s: all %d blocks resident; ready", me, event.get("total"))

    try:
        node = TransferNode(spec, me, paced(make_transport(st.transport), st.transfer_bytes_per_s), blocks=blocks if blocks is not None and model.complete else None,
                            on_progress=on_progress)
        await node.start()
    except (ValueError, TransportError) as e:
        raise PlanLoadError(400, f"cannot start the transfer: {e}", "peers") from None
    st.instance = me
    st.plan = doc
    if not model.complete:
        st.phase = "loading"

    async def run() -> None:
        try:
            summary = await node.run()
            log.info("transfer done: %s", summary)
        except Exception as e:  # a failed transfer leaves the engine loading, visible in status
            log.error("transfer failed on %s: %s", me, e)
            st.load_error = str(e)
        finally:
            await node.close()

    st.loading = asyncio.create_task(run())


async def start_source_load(st: Any, path: str) -> None:
    """Load the first copy from a checkpoint directory (a volume the pod mounts), in the background."""
    d = Path(path)
    if not (d / "config.json").is_file():
        raise PlanLoadError(400, f"invalid field 'source.path': {path} is not a checkpoint directory (no config.json)",
                            "source.path")
    if st.loading is not None and not st.loading.done():
        raise PlanLoadError(409, "a load is already running on this engine", "source")
    model = st.engine.model
    st.phase, st.load_error = "loading", None

    async def run() -> None:
        started = time.monotonic()
        try:
            blocks = await asyncio.to_thread(pack_checkpoint, d, st.model_name)
            if blocks.config.get("num_hidden_layers") != model.shape.layers:
                raise CheckpointError(f"{path}: {blocks.config.get('num_hidden_layers')} layers, this engine "
                                      f"was started for {model.shape.layers}")
            for b in blocks.blocks.values():  # model order: embed, layers, head
                model.add_block(b.id, b.tensors())
                st.bytes_received += b.nbytes
            st.blockset = blocks
            st.transfer_bw = blocks.total_bytes / max(1e-6, time.monotonic() - started)
            if st.phase == "loading":
                st.phase = "ready"
            log.info("loaded %s from %s: %d blocks, %.1f MB in %.2f s", st.model_name, path, len(blocks.blocks),
                     blocks.total_bytes / 1e6, time.monotonic() - started)
        except (CheckpointError, OSError, ValueError) as e:
            log.error("loading %s from %s failed: %s", st.model_name, path, e)
            st.load_error = f"source {path}: {e}"

    st.loading = asyncio.create_task(run())


def drop_weights(st: Any) -> None:
    """Release: the engine goes back to the pool holding nothing (the device memory is for the next model)."""
    st.engine.model.weights.clear()
    st.blockset, st.plan, st.load_error, st.bytes_received, st.transfer_bw = None, None, None, 0, 0.0
