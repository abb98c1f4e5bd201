"""EngineInstance: the one owner of an engine's long-lived state, with an explicit `Phase`.

It owns the model (weights per block, on the configured device and dtype), the batching engine and its
scheduler, the loader task (a plan's `TransferNode` or a checkpoint read), the live-split `Finisher`,
the request streams (`Serving`) and the metrics. The HTTP layer (server.py, control.py) only parses
and calls: bind / load_plan / load_source / cooperate / drain / release / status. Loading is loader.py's,
cooperation with peers (pair, pipeline hop, standby, redirect) is peering.py's: both act on this instance.

Phases (empty -> bound -> loading -> live -> serving -> draining -> released):
  empty     no service, no weights (a warm-pool engine)       bound    bound to a service, no weights yet
  loading   blocks arriving, nothing runnable here yet         live     partial prefix resident and a
  serving   every block resident: serves requests                       cooperating peer: serves split
  draining  finishing in-flight requests, refusing new ones    released weights dropped (bind again)
A released engine may keep its weights in host memory (`host_copy`, within --host-cache-gib): it then
feeds load plans as a host source while staying released, and `bind` with source.hostCopy reloads from
it (a memory copy). The copy stays kept while the engine serves from it (it is the blockset a serving
engine holds in host memory anyway), and a serving engine asked to (`keep_copy`, POST host-copy) keeps its
blockset as one, so a model's copy count is never zero while a service serves it. Releasing with
keepHostCopy=false (or host-copy keep=false) ends the copy.
With a node cache (--node-cache-dir, weights/nodecopy.py) the blockset and the host copy are the node's one mapped
copy of the model, shared by every engine of the node (status `nodeCopy`): the engine holds its lease while it
serves from it or keeps it as its host copy, and drops it when it does neither (the node may then evict it).
An engine started with a full checkpoint is `serving` at once (unbound); one started with
`--resident-layers` is `loading`.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

from kascade_engine import peering
from kascade_engine.batch.engine import Engine
from kascade_engine.batch.families import expected_shapes
from kascade_engine.batch.kvcache import kv_tokens_for_memory
from kascade_engine.batch.model import LlamaModel, LlamaShape
from kascade_engine.batch.scheduler import Limits
from kascade_engine.config import EngineConfig
from kascade_engine.live.cooperation import HostRows
from kascade_engine.live.liveredirect import Forwarder, ForwardHost
from kascade_engine.live.pairclient import PairClient
from kascade_engine.live.split import Finisher
from kascade_engine.metrics import EngineMetrics
from kascade_engine.modelswitch import switch_model
from kascade_engine.net.pacing import egress_bucket
from kascade_engine.net.peerpool import PeerPool
from kascade_engine.pd.handback import DEFAULT_HAND_BACK_S, HandBack
from kascade_engine.pd.metrics import PDMetrics
from kascade_engine.pd.prefill_server import PrefillServer
from kascade_engine.pd.probe import PrefillProbe
from kascade_engine.pd.remote_prefill import RemotePrefill
from kascade_engine.refusal import InstanceError
from kascade_engine.tokenizer import Tokenizer
from kascade_engine.weights.hostcopy import keepable
from kascade_engine.weights.nodecopy import NodeCopies
from kascade_planner.engine_api import (
    BindRequest,
    ConvertRequest,
    CooperateRequest,
    EngineStatus,
    HostCopyAnswer,
    HostCopyRequest,
    LoadPlanRequest,
    Phase,
)

log = logging.getLogger(__name__)


class EngineInstance:
    def __init__(self, config: EngineConfig, model_cfg: dict[str, Any], tokenizer: Tokenizer,
                 blockset: Any = None, node: NodeCopies | None = None) -> None:
        self.config = config
        self.model_cfg = dict(model_cfg)
        self.tokenizer = tokenizer
        self.device = config.torch_device()
        self.metrics = EngineMetrics(config.model_name)
        self.model_service: str | None = None
        self.role = "colocated"
        self.cooperate: dict[str, str] = {}
        self.blockset: Any = None  # a complete copy held here (sources send from it)
        self.tp_load_stats: list[Any] = []  # per rank bytes/seconds of the last load by rank planes (tp/planload.py)
        # a TP instance loaded by matched-TP slices holds no whole block: the whole blocks' manifest it loaded by
        self.tp_whole_manifest: dict[str, Any] | None = None
        self.host_copy: Any = None  # a BlockSet kept in host memory after release (None: none)
        self.node = node  # the node cache (--node-cache-dir): blockset and host copy are its mapped copy
        self.host_feeding = False  # a plan load running only as a host source (the phase stays released)
        self.bytes_received = 0
        self.transfer_bw = 0.0
        self.transfer_failures = 0  # load plans that failed here, for the lifetime of the process (a counter)
        self.load_error: str | None = None
        self.loading: asyncio.Task[None] | None = None
        self.plan: dict[str, Any] | None = None
        self.instance_id = config.instance
        # The data port's transport (--transport, with --tls-* for tcp): the act-port listener (CLI), the
        # activation/pair connections (`peers`) and the KV connections of disaggregated serving
        # (`remote_prefill`) all speak it, so peers configured alike reach each other whatever it is. Its TCP
        # sockets carry the activation class (--activation-dscp): a QoS fabric sends them ahead of weights.
        self.transport = config.activation_transport()
        # one egress budget for the data plane (--transfer-max-mbps): weight plans wait on it, KV frames charge it
        self.egress = egress_bucket(config.transfer_bytes_per_s)
        self.rebuild(config)
        self.phase = Phase.EMPTY
        if blockset is not None:
            self.add_blockset(blockset, config.resident_layers)
        if self.model.complete:
            self.phase = Phase.SERVING
        elif self.model.weights:
            self.phase = Phase.LOADING

    def _kv_tokens_auto(self, config: EngineConfig) -> int:
        """CUDA: the KV capacity --gpu-memory-utilization leaves after the weights (UNVERIFIED on a GPU)."""
        import torch

        dev = config.torch_device()
        free, total = torch.cuda.mem_get_info(dev)
        size = torch.empty((), dtype=self.dtype).element_size()
        weights = sum(math.prod(shape) for shape in expected_shapes(self.model_cfg).values()) * size
        s = LlamaShape.from_config(self.model_cfg)
        return kv_tokens_for_memory(free, total, config.gpu_memory_utilization, weights,
                                    2 * s.layers * s.kv_heads * s.head_dim * size, config.page_size)

    def rebuild(self, config: EngineConfig) -> None:
        """(Re)make the model, the batching engine and what hangs on them for `config` (at start, on a dtype
        change at bind, on a model switch: modelswitch.py); the request side survives a rebuild."""
        from kascade_engine.serving import Serving

        self.dtype = config.torch_dtype(self.model_cfg)
        config = config.resolved(self.model_cfg, lambda: self._kv_tokens_auto(config))
        self.config = config
        c = config
        limits = Limits(c.max_batch_tokens, c.max_seqs, c.kv_tokens, c.page_size)
        self.engine: Engine
        self.model: LlamaModel  # a tp/RankModel on rank 0 of a tensor-parallel instance
        if c.tp > 1:  # this process is rank 0 of a tensor-parallel instance (tp/launch.py)
            if hasattr(self, "ranks"):
                raise InstanceError(409, f"dtype: fixed at start for tp {c.tp} (its ranks run {self.dtype})", "dtype")
            from kascade_engine.tp.launch import exit_on_lost, start

            self.ranks = start(self.model_cfg, c.checkpoint, c.tp, limits, self.device, self.dtype,
                               self.tokenizer.eos_token_id, c.threads, on_lost=exit_on_lost, empty=c.empty,
                               resident_layers=c.resident_layers)
            self.model, self.engine = self.ranks.engine.model, self.ranks.engine
        else:
            self.model = LlamaModel(self.model_cfg, dtype=self.dtype, device=self.device)
            self.engine = Engine(self.model, limits, eos=self.tokenizer.eos_token_id, cuda_graphs=c.cuda_graphs)
        self.peers = PeerPool(self.transport, config.token)  # activation connections opened ahead
        self.host = HostRows(
            layer_s=config.emulate_layer_ms / 1e3, knee_tokens=config.emulate_knee_tokens
        )  # pair sessions (a loading peer's rows) join this engine's batch
        self.engine.coop = self.host  # a TP engine's ranks run hosted rows too (tp/leader.py `run_rows`)
        self.pair: PairClient | None = None  # while loading with a peer: our rows finish there
        self._warming: asyncio.Task[None] | None = None  # ZigZag plans computed in the background (livepolicy)
        self.downstream_peer: str | None = None  # pipeline: where hosted rows go on (status `pipelineDownstream`)
        if not hasattr(self, "serving"):  # a dtype rebuild keeps the request side and its running loop
            self.serving = Serving(self)
            self.pd_metrics = PDMetrics(self.metrics.registry, config.model_name)
            self.pd_metrics.export_velocity(self.metrics.registry, lambda: self.engine.meter)
            self.prefill_server = PrefillServer(self)  # PD: prefill for decode engines, KV out on the data port
            self.remote_prefill = RemotePrefill(self)  # PD: our requests' prefill on a peer, KV in
            self.handback = HandBack(self)  # converted: prompts with no prefill room go to a prefill engine
            self.probe = PrefillProbe(self)  # converted: the prefill rate measured before prompts depend on it
            self.forward_host = ForwardHost(self)  # sources hand us their queued requests (liveredirect.py)
            # peers our queued requests may go to (a source: the pipeline head; a head: the sources), one session each
            self.forwarders: dict[str, Forwarder] = {}
        self.finisher = Finisher(self.model, busy=lambda: not self.engine.scheduler.idle, token=config.token,
                                 host=self.host, wake=lambda: self.serving.wake.set(), prefill=self.prefill_server,
                                 forward=self.forward_host)

    # -- phase ---------------------------------------------------------------------------------
    def _to(self, phase: Phase) -> None:
        if phase is not self.phase:
            log.info("%s: %s -> %s", self.instance_id, self.phase.value, phase.value)
            self.phase = phase

    def settle(self) -> None:
        """`_settle` for the loaders outside this class (tp/planload.py: blocks installed all at once)."""
        self._settle()

    def _settle(self) -> None:
        """After blocks arrive or cooperation changes: loading / live / serving follow residency."""
        if self.phase is Phase.DRAINING:
            return
        if self.phase in (Phase.EMPTY, Phase.RELEASED) and not (
                (self.busy_loading and not self.host_feeding) or self.model.weights):
            return
        m = self.model
        if m.complete:
            self._to(Phase.SERVING)
        elif self.cooperate and m.resident("embed"):
            self._to(Phase.LIVE)
        elif m.weights or self.busy_loading:
            self._to(Phase.LOADING)

    @property
    def busy_loading(self) -> bool:
        return self.loading is not None and not self.loading.done()

    def begin_loading(self) -> None:
        if not self.model.complete and self.phase is not Phase.DRAINING:
            self._to(Phase.LOADING)
        self._settle()

    @property
    def context_len(self) -> int:
        """Longest sequence (prompt + completion) one request may reach here."""
        sched = self.engine.scheduler
        if sched.window is not None and sched.resident(self.model.shape.max_positions) <= sched.pool.capacity_tokens:
            return self.model.shape.max_positions  # pages outside the window are reclaimed as it slides
        return min(self.model.shape.max_positions, sched.pool.capacity_tokens)

    @property
    def ready(self) -> bool:
        return self.phase is Phase.SERVING and self.model.complete

    @property
    def servable(self) -> bool:
        """Readiness (/readyz): new requests may be served now, locally or split with a live peer. Never
        while empty, bound, loading alone, draining or released."""
        return self.phase is Phase.SERVING or (
            self.phase is Phase.LIVE and bool(self.cooperate) and self.model.resident("embed"))

    @property
    def serving_share(self) -> float:
        """What this replica adds to serving, in full replicas' worth of accelerators (routers weight by it):
        1 serving alone; while live with a source, its resident prefix over all layers (the source runs the
        rest of each request, on its own accelerator's time); as the head of an execute-while-load pipeline
        of k receivers, up to k (λScale: no source runs any of its layers, and k accelerators each run their
        own layers of every request) but no more than L / its stage: the head admits every request of the
        pipeline, once per step of its stage's layers, so the pipeline serves at most that many times what a
        replica stepping through all L layers does (a weight of 1 gave the head one source's traffic while
        the other receivers idled between its steps; k = 4 with a 3-of-8-layer head queued more than it
        admitted); 0 when it cannot serve."""
        if self.phase is Phase.SERVING:
            return 1.0
        if not self.servable:
            return 0.0
        if self.pair is not None and not self.pair.peer_complete:
            L, stage = self.model.shape.layers, self.pair.stage or self.model.resident_prefix()
            return min(1.0 + self.pair.peer_receivers, L / max(1, stage))
        return self.model.resident_prefix() / max(1, self.model.shape.layers)

    def accepting(self) -> None:
        """Raise unless new requests may be served now (locally or split with a peer)."""
        if self.servable:
            return
        m = self.model
        if self.phase in (Phase.LOADING, Phase.LIVE, Phase.BOUND):
            raise InstanceError(503, f"engine is loading ({m.resident_prefix()}/{m.shape.layers} layers resident)")
        raise InstanceError(503, f"engine is {self.phase.value}; not accepting requests")

    # -- weights -------------------------------------------------------------------------------
    def add_block(self, block: Any | None) -> None:
        """Make `block` runnable (None: it was added to the model already, by an upload off the loop: loader.py)
        and let the phase follow residency."""
        if block is not None:
            self.model.add_block(block.id, block.tensors())
        self._settle()

    def add_blockset(self, blocks: Any, resident_layers: int | None = None) -> None:
        if resident_layers is None:
            for b in blocks.blocks.values():
                self.model.add_block(b.id, b.tensors())
            self.blockset = blocks
        else:  # a load in progress (demos, tests): embed + the first layers; never a source
            for bid in ("embed", *(f"layer.{i}" for i in range(resident_layers))):
                self.model.add_block(bid, blocks.blocks[bid].tensors())
        self._settle()

    # -- control calls -------------------------------------------------------------------------
    async def bind(self, req: BindRequest) -> EngineStatus:
        if req.source_host_copy and self.host_copy is None:
            raise InstanceError(409, "source.hostCopy: this engine keeps no host copy (status hostCopyBytes is 0)",
                                "source.hostCopy")
        if req.source_node_copy and self.node is None:
            raise InstanceError(409, "source.nodeCopy: this engine has no node cache (--node-cache-dir)",
                                "source.nodeCopy")
        if req.model != self.config.model_name:
            if req.model_path is None:
                raise InstanceError(409, f"cannot bind model '{req.model}': this engine holds "
                                    f"'{self.config.model_name}' (modelPath switches an engine holding no weights)",
                                    "model")
            switch_model(self, req.model, req.model_path)
        if self.model_service not in (None, req.model_service):
            raise InstanceError(409, f"engine is bound to '{self.model_service}'; release it first", "modelService")
        if req.dtype is not None and str(self.dtype).removeprefix("torch.") != req.dtype:
            if self.model.weights or not self.serving.idle:
                raise InstanceError(409, f"engine holds {self.dtype} weights; cannot switch to {req.dtype} "
                                    "(release it first)", "dtype")
            self.rebuild(self.config.with_dtype(req.dtype))
        self.model_service, self.role = req.model_service, req.role
        if self.phase in (Phase.EMPTY, Phase.RELEASED):
            self._to(Phase.BOUND)
        self._settle()
        has_source = req.source_path is not None or req.source_uri is not None
        if req.source_host_copy and not self.model.complete:
            from kascade_engine.loader import start_host_load

            await start_host_load(self)
            self._settle()
        elif req.source_node_copy and not self.model.complete:
            from kascade_engine.loader import start_node_copy_load

            await start_node_copy_load(self)
            self._settle()
        elif has_source and not self.model.complete and (self.loading is None or self.loading.done()):
            await self.load_source(req.source_path, req.source_uri)
        return self.status()

    async def load_plan(self, req: LoadPlanRequest) -> EngineStatus:
        from kascade_engine.loader import start_plan_load

        await start_plan_load(self, req)
        self._settle()
        return self.status()

    async def load_source(self, path: str | None, uri: str | None = None) -> EngineStatus:
        from kascade_engine.loader import start_source_load

        await start_source_load(self, path, uri)
        self._settle()
        return self.status()

    async def set_cooperate(self, req: CooperateRequest) -> EngineStatus:
        """Form, change or end cooperation with a peer: pair, pipeline hop, standby or redirect (peering.py)."""
        return await peering.set_cooperate(self, req)

    def convert(self, req: ConvertRequest) -> EngineStatus:
        """Convertible decoder (TokenScale): prefill at most `prefill_chunk_tokens` prompt tokens per step
        (None: no cap), and with `step_budget_ms` only what the engine's measured step cost predicts within it
        in a step that decodes (scheduler.py, stepcost.py). The data port serves other decode engines' prefill whatever
        the role; the router
        sends it some once the pod is annotated convertible."""
        lim = self.engine.limits
        changed = (req.prefill_chunk_tokens, req.step_budget_ms) != (
            lim.prefill_chunk_tokens, None if lim.step_budget_s is None else lim.step_budget_s * 1e3)
        if changed:
            self.engine.meter.reset_rate()  # the prefill rate was measured under the old budgets
        # the step thread reads both between steps: a cap is set after its time budget and cleared before it,
        # so no step runs under a new cap without its budget
        if req.prefill_chunk_tokens is None:
            lim.prefill_chunk_tokens = lim.step_budget_s = None
            self.handback.after_s = None  # prompts already watched keep their checks; new ones are not watched
        else:
            lim.step_budget_s = None if req.step_budget_ms is None else req.step_budget_ms / 1e3
            lim.prefill_chunk_tokens = req.prefill_chunk_tokens
            self.handback.after_s = DEFAULT_HAND_BACK_S if req.hand_back_ms is None else req.hand_back_ms / 1e3
        if changed:  # measure the rate under the new budgets now (probe.py); taken back: end a probe still running
            self.probe.start()
        log.info("%s: prefill chunk budget %s, step budget %s, hand-back after %s", self.instance_id,
                 req.prefill_chunk_tokens or "unlimited", f"{req.step_budget_ms} ms" if lim.step_budget_s else "none",
                 f"{self.handback.after_s:g} s" if self.handback.after_s is not None else "never")
        return self.status()

    def drain(self) -> EngineStatus:
        self._to(Phase.DRAINING)  # new requests get 503; in-flight ones finish
        return self.status()

    def release(self, keep_host_copy: bool | None = None) -> EngineStatus:
        if not self.serving.idle:
            raise InstanceError(409, "requests still in flight; drain first and wait")
        if self.loading is not None and not self.loading.done():
            self.loading.cancel()
        self._keep_host_copy(keep_host_copy)
        self.model_service, self.role, self.cooperate = None, "colocated", {}
        if self.pair is not None:
            asyncio.get_running_loop().create_task(self.pair.close())
            self.pair = None
            self.engine.set_hook(self.host)
            self.engine.scheduler.whole_prompts = False
        down, self.host.downstream, self.downstream_peer = self.host.downstream, None, None
        if down is not None:
            asyncio.get_running_loop().create_task(down.close())
        fwds, self.forwarders = list(self.forwarders.values()), {}
        for fwd in fwds:  # idle: nothing of ours runs there
            asyncio.get_running_loop().create_task(fwd.close())
        self.model.weights.clear()  # the device memory is for the next model
        self.probe.stop()
        self.engine.reset()
        self.blockset, self.plan, self.load_error, self.bytes_received, self.transfer_bw = None, None, None, 0, 0.0
        self.tp_whole_manifest = None
        self._drop_node_copy()
        self._to(Phase.RELEASED)
        return self.status()

    def _keep_host_copy(self, keep: bool | None) -> None:
        """On release: the complete copy held here stays in host memory when the --host-cache-gib budget
        holds it (keep None or True); keep=False drops any copy (the operator keeps O(1) per model)."""
        full = self.blockset if self.blockset is not None and self.model.complete else None
        if keep is False:
            self.host_copy = None
        elif full is not None:
            self.host_copy, why = keepable(full, self.config.host_cache_bytes, self.config.model_name)
            if why is not None:
                log.info("%s: not keeping a host copy: %s", self.instance_id, why)
        if self.host_copy is not None:
            log.info("%s: keeping a host copy of %s (%.1f MB)", self.instance_id, self.config.model_name,
                     self.host_copy.total_bytes / 1e6)

    def _drop_node_copy(self) -> None:
        """Leave the node's copy evictable once this engine neither serves from it nor keeps it."""
        if self.node is not None and self.blockset is None and self.host_copy is None:
            self.node.drop()

    def keep_copy(self, req: HostCopyRequest) -> HostCopyAnswer:
        """POST host-copy: keep the complete copy this serving engine holds as its host copy when the
        --host-cache-gib budget holds it (hostcopy.keepable: no extra bytes), or drop the host copy (keep=false);
        either way it serves on. Answers the bytes kept, or 0 and why not."""
        if not req.keep:
            if self.host_copy is not None:
                log.info("%s: dropping the host copy of %s on request", self.instance_id, self.config.model_name)
            self.host_copy = None
            self._drop_node_copy()
            return HostCopyAnswer(0)
        if self.host_copy is not None:
            return HostCopyAnswer(self.host_copy.total_bytes)
        if self.phase not in (Phase.SERVING, Phase.DRAINING):
            return HostCopyAnswer(0, f"engine is {self.phase.value} and holds no complete copy of "
                                     f"{self.config.model_name} to keep")
        full = self.blockset if self.blockset is not None and self.model.complete else None
        kept, why = keepable(full, self.config.host_cache_bytes, self.config.model_name)
        if kept is None:
            return HostCopyAnswer(0, why)
        self.host_copy = kept
        log.info("%s: keeping a host copy of %s while serving (%.1f MB)", self.instance_id, self.config.model_name,
                 kept.total_bytes / 1e6)
        return HostCopyAnswer(kept.total_bytes)

    def status(self) -> EngineStatus:
        m = self.model
        ids = ["embed", *(f"layer.{i}" for i in range(m.shape.layers)), "head"]
        return EngineStatus(self.instance_id, self.config.model_name, self.phase, self.role, self.model_service,
                            {b: m.resident(b) for b in ids}, self.bytes_received, self.ready,
                            self.cooperate or None, self.load_error, str(self.device),
                            str(self.dtype).removeprefix("torch."),
                            {"tensorDevices": self.tensor_devices(),
                             **({"nodeCopy": self.node.path} if self.node is not None and self.node.path else {}),
                             **({"tpLoad": self.tp_load_stats} if self.tp_load_stats else {}),
                             **({"pipelineDownstream": self.downstream_peer} if self.downstream_peer else {}),
                             **({"redirect": sorted(self.forwarders)} if self.forwarders else {}),
                             **({"prefillChunkTokens": self.engine.limits.prefill_chunk_tokens}
                                if self.engine.limits.prefill_chunk_tokens else {}),
                             **({"stepBudgetMs": self.engine.limits.step_budget_s * 1e3}
                                if self.engine.limits.prefill_chunk_tokens and self.engine.limits.step_budget_s
                                else {}),
                             **({"handBackMs": self.handback.after_s * 1e3}
                                if self.engine.limits.prefill_chunk_tokens and self.handback.after_s is not None
                                else {})},
                            self.host_copy.total_bytes if self.host_copy is not None else 0)

    def tensor_devices(self) -> dict[str, int]:
        """Resident weight tensors and the two KV cache tensors per device (`cuda:0`: 242): where every
        tensor actually is, for checks that a model loaded onto the device it was asked for."""
        out: dict[str, int] = {}
        cache = self.engine.cache
        # a snapshot first: a load adds blocks from a worker thread (loader.py on CUDA, tp/planload.py), and a
        # Python-level loop over the dict itself may see it grow ("dictionary changed size": a 500 on status).
        # list() of a dict view allocates no GC object mid-copy, so no other thread runs inside it; a block's own
        # dict never changes once added
        blocks = list(self.model.weights.values())
        for t in [*(v for w in blocks for v in w.values()), cache.k, cache.v]:
            out[str(t.device)] = out.get(str(t.device), 0) + 1
        return out

    async def close(self) -> None:
        for fwd in list(self.forwarders.values()):
            await fwd.close()
        await self.forward_host.close()
        await self.peers.close()
        await self.remote_prefill.close()
        if self.pair is not None:
            await self.pair.close()
        if self.loading is not None and not self.loading.done():
            self.loading.cancel()
        await self.serving.close()
        if self.config.tp > 1:
            self.ranks.stop()
