"""The engine control API's messages (`/kascade/v1/...`), typed once for both ends: the operator's
`EngineClient` builds them with `to_dict()`, the engine's control routes parse them with `from_dict()`
(an error names the field), and the engine's `status` answer is an `EngineStatus`.

Pure stdlib (the planner package stays free of pydantic/fastapi): frozen dataclasses and explicit
checks. Field names on the wire are camelCase as the operator has always sent them.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

ROLES = ("prefill", "decode", "colocated")
MODES = ("zigzag", "besteffort", "standby", "pipeline", "redirect", "off")
DTYPES = ("bfloat16", "float16", "float32")
# Engine phases, in lifecycle order (see kascade_engine.instance.Phase).
PHASES = ("empty", "bound", "loading", "live", "serving", "draining", "released")

# Response header on every OpenAI answer of an engine: the share of a request's layers it runs itself
# (1 serving alone; resident prefix / layers while live, its pair runs the rest). Routers weight by it.
SERVING_SHARE_HEADER = "X-Kascade-Serving-Share"
# Response header of a converted decoder: the prompt tokens its step budget would give a chunk now, beside its
# current decodes (Scheduler.prefill_room). Routers send it a prompt only while this is at least their minimum.
PREFILL_ROOM_HEADER = "X-Kascade-Prefill-Room"
# Response header of an engine on its answers and /readyz: the prompt tokens/s it actually prefilled over its
# recent steps while prompts waited (kascade_engine.batch.velocity: a prefill engine's velocity; a converted decoder's
# rate under its chunk and step budgets, beside its decodes), absent until measured. A router weighs a converted
# decoder as this over a prefill engine's (kascade_planner.conversion.converted_share).
PREFILL_RATE_HEADER = "X-Kascade-Prefill-Rate"
# Request header from a router to a converted decoder it lets prefill a prompt itself: host:port of a prefill
# engine's data port. If the decoder's step budget leaves the prompt no prefill progress for its hand-back bound
# (ConvertRequest.hand_back_ms) before any token, the decoder hands the prompt to that engine (its KV comes back
# as in disaggregated serving) instead of holding it until its batch drains.
PREFILL_FALLBACK_HEADER = "X-Kascade-Prefill-Fallback"
# Request header from a router to a decode engine (disaggregated serving): host:port of the data port of the engine
# that prefills the prompt (a prefill engine, or a converted decoder, which then comes with PREFILL_FALLBACK_HEADER).
PREFILL_HEADER = "X-Kascade-Prefill"
# Request header from a router that holds the engine token: `prefill_signature` over the PREFILL_HEADER and
# PREFILL_FALLBACK_HEADER values it sends. An engine started with --require-prefill-signature dials only addresses
# a router signed, so a client that reaches an engine's HTTP port cannot make it dial any host:port.
PREFILL_SIG_HEADER = "X-Kascade-Prefill-Sig"
# Response header on an answer whose prompt is prefilled elsewhere than the router said (`HandedBack`): a converted
# decoder handed it to the fallback prefill engine, or a converted decoder named in PREFILL_HEADER declined it or
# handed it back and the decode engine prefills it on the fallback or itself. An answer to a request that may be
# handed back (PREFILL_FALLBACK_HEADER present) starts only once that is settled (the prompt's prefill op went to
# the fallback, this engine prefills it, or its first token came from the engine named), so the router counts the
# prompt on the engine that prefills it from then on (its PD accounting, first-token timing, X-Kascade-Prefilled-By).
HANDED_BACK_HEADER = "X-Kascade-Handed-Back"
HANDED_BACK_HERE = "here"  # HANDED_BACK_HEADER's value when the answering engine prefills the prompt itself


def prefill_signature(token: str, prefill: str | None, fallback: str | None) -> str:
    """PREFILL_SIG_HEADER's value: HMAC-SHA256 keyed by the engine token over the two peer headers' values."""
    msg = f"kascade-prefill-v1\n{prefill or ''}\n{fallback or ''}".encode()
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class HandedBack:
    """HANDED_BACK_HEADER's message: who prefills a prompt the router named another engine for (`to`: the data
    address host:port of the prefill engine it went to; None: the answering engine itself)."""

    to: str | None

    def header(self) -> str:
        return HANDED_BACK_HERE if self.to is None else self.to

    @staticmethod
    def parse(value: str) -> HandedBack:
        """From the header's value; a WireError naming the header when it is neither host:port nor HANDED_BACK_HERE."""
        if value == HANDED_BACK_HERE:
            return HandedBack(None)
        host, _, port = value.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise WireError(HANDED_BACK_HEADER, f"expected host:port or {HANDED_BACK_HERE!r}, got {value!r}")
        return HandedBack(value)

# spec.model.source.uri / bind source.uri: a Hugging Face Hub repo, REVISION a branch, tag or commit
# (the CRD's pattern, the operator's pydantic mirror and the engine's parser all use this one)
MODEL_URI_PATTERN = (r"^(file:///.*|hf://[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
                     r"(@[A-Za-z0-9][A-Za-z0-9._-]{0,199})?)$")

Role = Literal["prefill", "decode", "colocated"]
Mode = Literal["zigzag", "besteffort", "standby", "pipeline", "redirect", "off"]


class WireError(ValueError):
    """A control message that does not parse; `field` names the offending field (dotted path)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"invalid field '{field}': {message}")
        self.field = field


def _obj(doc: object, where: str = "body") -> Mapping[str, Any]:
    if not isinstance(doc, Mapping):
        raise WireError(where, f"must be a JSON object, got {type(doc).__name__}")
    return doc


def _only(doc: Mapping[str, Any], allowed: tuple[str, ...], prefix: str = "") -> None:
    for k in doc:
        if k not in allowed:
            raise WireError(prefix + str(k), f"unknown field (allowed: {', '.join(allowed)})")


def _str(
    doc: Mapping[str, Any], key: str, prefix: str = "", required: bool = True, nonempty: bool = True
) -> str | None:
    v = doc.get(key)
    if v is None:
        if required:
            raise WireError(prefix + key, "field required")
        return None
    if not isinstance(v, str) or (nonempty and not v):
        raise WireError(prefix + key, f"must be a non-empty string, got {v!r}")
    return v


def _choice(doc: Mapping[str, Any], key: str, choices: tuple[str, ...], required: bool = True) -> str | None:
    v = _str(doc, key, required=required)
    if v is not None and v not in choices:
        raise WireError(key, f"must be one of {', '.join(choices)}, got {v!r}")
    return v


def _num(doc: Mapping[str, Any], key: str, default: float, lo: float) -> float:
    v = doc.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < lo:
        raise WireError(key, f"must be a number >= {lo}, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class BindRequest:
    """Bind an engine to a ModelService; with a source it also loads the first copy: `source_path`, a
    checkpoint directory the pod mounts, or `source_uri` (`hf://OWNER/NAME[@REVISION]`, the service's
    spec.model.source.uri), which the engine downloads first (kascade_engine.weights.modelsource). At most one.
    `dtype` is spec.model.dtype: the precision the engine computes in (None: the engine's own).
    `source_host_copy`: load from the host copy this engine kept when it was last released (`hostCopyBytes`
    in its status): a memory copy, no disk or network. `source_node_copy`: load from the copy of `model` its node's
    cache holds (--node-cache-dir; another engine of the node published it): mapped read-only, its digests
    verified, no disk or network. `model_path`: a directory holding `model`'s config.json
    and tokenizer (its checkpoint as the pod mounts it): an engine started for another model and holding no
    weights switches to `model` first (a GPU of the shared pool changes model; weights then come by plan or
    source as usual)."""

    model: str
    model_service: str
    role: Role = "colocated"
    source_path: str | None = None
    dtype: str | None = None
    source_uri: str | None = None
    source_host_copy: bool = False
    model_path: str | None = None
    source_node_copy: bool = False

    def __post_init__(self) -> None:
        if sum((self.source_path is not None, self.source_uri is not None, self.source_host_copy,
                self.source_node_copy)) > 1:
            raise WireError("source", "give one of path, uri, hostCopy, nodeCopy")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"model": self.model, "modelService": self.model_service, "role": self.role}
        if self.source_path is not None:
            d["source"] = {"path": self.source_path}
        if self.source_uri is not None:
            d["source"] = {"uri": self.source_uri}
        if self.source_host_copy:
            d["source"] = {"hostCopy": True}
        if self.source_node_copy:
            d["source"] = {"nodeCopy": True}
        if self.dtype is not None:
            d["dtype"] = self.dtype
        if self.model_path is not None:
            d["modelPath"] = self.model_path
        return d

    @staticmethod
    def from_dict(doc: object) -> BindRequest:
        d = _obj(doc)
        _only(d, ("model", "modelService", "role", "source", "dtype", "modelPath"))
        model_path = _str(d, "modelPath", required=False)
        src = d.get("source")
        path = uri = None
        if src is not None:
            s = _obj(src, "source")
            _only(s, ("path", "uri", "hostCopy", "nodeCopy"), "source.")
            if len(s) != 1:
                raise WireError("source", "give exactly one of path, uri, hostCopy, nodeCopy")
            for flag in ("hostCopy", "nodeCopy"):
                if flag in s:
                    if s[flag] is not True:
                        raise WireError(f"source.{flag}", f"must be true, got {s[flag]!r}")
                    return BindRequest(cast(str, _str(d, "model")), cast(str, _str(d, "modelService")),
                                       cast(Role, _choice(d, "role", ROLES)), None,
                                       _choice(d, "dtype", DTYPES, required=False), None, flag == "hostCopy",
                                       model_path, flag == "nodeCopy")
            path = _str(s, "path", "source.", required=False)
            uri = _str(s, "uri", "source.", required=False)
            if uri is not None and (not re.match(MODEL_URI_PATTERN, uri) or ".." in uri.split("/")):
                raise WireError("source.uri", f"must be hf://OWNER/NAME[@REVISION] or file:///DIR, got {uri!r}")
        return BindRequest(cast(str, _str(d, "model")), cast(str, _str(d, "modelService")),
                           cast(Role, _choice(d, "role", ROLES)), path, _choice(d, "dtype", DTYPES, required=False),
                           uri, False, model_path)


@dataclass(frozen=True)
class LoadPlanRequest:
    """Take part in a transfer plan as `self_id` (a source sends from its copy, a target receives)."""

    plan: Mapping[str, Any]
    self_id: str
    peers: Mapping[str, str]
    plan_token: str
    manifest: Mapping[str, Any] | None = None  # targets need it; sources use their own
    chunk_bytes: int = 1 << 20
    timeout_seconds: float = 10.0

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"plan": dict(self.plan), "self": self.self_id, "peers": dict(self.peers),
                             "planToken": self.plan_token, "chunkBytes": self.chunk_bytes,
                             "timeoutSeconds": self.timeout_seconds}
        if self.manifest is not None:
            d["manifest"] = dict(self.manifest)
        return d

    @staticmethod
    def from_dict(doc: object) -> LoadPlanRequest:
        d = _obj(doc)
        _only(d, ("plan", "self", "peers", "planToken", "manifest", "chunkBytes", "timeoutSeconds"))
        if "plan" not in d:
            raise WireError("plan", "field required")
        plan = _obj(d["plan"], "plan")
        peers = _obj(d.get("peers"), "peers")
        for k, v in peers.items():
            if not isinstance(v, str) or not v:
                raise WireError(f"peers.{k}", f"must be a 'host:port' string, got {v!r}")
        manifest = None if d.get("manifest") is None else _obj(d["manifest"], "manifest")
        chunk = d.get("chunkBytes", 1 << 20)
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise WireError("chunkBytes", f"must be an integer >= 1, got {chunk!r}")
        return LoadPlanRequest(plan, cast(str, _str(d, "self")), dict(peers), cast(str, _str(d, "planToken")),
                               manifest, chunk, _num(d, "timeoutSeconds", 10.0, 0.001))


@dataclass(frozen=True)
class ZigZagSpec:
    """The pair's ZigZag setting (kascade_planner.zigzag.PairSetting; the engine knows the layers):
    `loadRatio` = loading one layer / computing one layer, `batches` scheduled, `ilp` = use the
    pipeline-configuration ILP's prefixes instead of the ILP-free schedule's."""

    load_ratio: float
    batches: int
    ilp: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"loadRatio": self.load_ratio, "batches": self.batches, "ilp": self.ilp}

    @staticmethod
    def from_dict(doc: object) -> ZigZagSpec:
        d = _obj(doc, "zigzag")
        _only(d, ("loadRatio", "batches", "ilp"), "zigzag.")
        lr, n, ilp = d.get("loadRatio"), d.get("batches"), d.get("ilp", False)
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 <= lr <= 1e6:
            raise WireError("zigzag.loadRatio", f"must be a number in [0, 1e6], got {lr!r}")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1024:
            raise WireError("zigzag.batches", f"must be an integer in 1..1024, got {n!r}")
        if not isinstance(ilp, bool):
            raise WireError("zigzag.ilp", f"must be a boolean, got {ilp!r}")
        return ZigZagSpec(float(lr), n, ilp)


@dataclass(frozen=True)
class CooperateRequest:
    """Serve split with `peer` (its activation port) while loading; mode `off` stops; `standby` only opens
    and authenticates the connection to `peer` ahead (at bind or pool join), so a later pairing pays no
    handshake; `pipeline` makes this engine a middle receiver of an execution pipeline (λScale): rows it
    hosts run the layers it holds and go on to `peer` for the rest."""

    peer: str
    mode: Mode
    zigzag: ZigZagSpec | None = None  # mode zigzag: follow this schedule (else best effort)

    def to_dict(self) -> dict[str, Any]:
        return {"peer": self.peer, "mode": self.mode, **({"zigzag": self.zigzag.to_dict()} if self.zigzag else {})}

    @staticmethod
    def from_dict(doc: object) -> CooperateRequest:
        d = _obj(doc)
        _only(d, ("peer", "mode", "zigzag"))
        mode = cast(Mode, _choice(d, "mode", MODES))
        zz = ZigZagSpec.from_dict(d["zigzag"]) if d.get("zigzag") is not None else None
        if zz is not None and mode != "zigzag":
            raise WireError("zigzag", f"only with mode zigzag, not {mode}")
        return CooperateRequest(cast(str, _str(d, "peer", nonempty=False)), mode, zz)


@dataclass(frozen=True)
class ReleaseRequest:
    """Unbind (after a drain). `keep_host_copy` False drops the weights and any host copy; None or True keep
    them in host memory as a host copy when the engine's --host-cache-gib budget holds the model. Releasing
    a released engine again only applies it (False drops the copy)."""

    keep_host_copy: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return {} if self.keep_host_copy is None else {"keepHostCopy": self.keep_host_copy}

    @staticmethod
    def from_dict(doc: object) -> ReleaseRequest:
        d = _obj(doc)
        _only(d, ("keepHostCopy",))
        v = d.get("keepHostCopy")
        if v is not None and not isinstance(v, bool):
            raise WireError("keepHostCopy", f"must be true, false or null, got {v!r}")
        return ReleaseRequest(v)


@dataclass(frozen=True)
class HostCopyRequest:
    """`POST host-copy`: a serving engine keeps (True) its complete copy of the model as a host copy, within
    its --host-cache-gib budget, or drops it (False) while it goes on serving. The operator asks one serving
    engine of a model that has no host copy anywhere (issue 18: O(1) per model, never zero while the service
    exists). Keeping costs no extra bytes: a serving engine holds its blockset in host memory already (a chain
    source's); the copy is what its release then keeps. Asking again is a no-op."""

    keep: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {"keep": self.keep}

    @staticmethod
    def from_dict(doc: object) -> HostCopyRequest:
        d = _obj(doc)
        _only(d, ("keep",))
        v = d.get("keep", True)
        if not isinstance(v, bool):
            raise WireError("keep", f"must be true or false, got {v!r}")
        return HostCopyRequest(v)


@dataclass(frozen=True)
class HostCopyAnswer:
    """What `POST host-copy` answers: the bytes of the host copy the engine now keeps (0: none) and, when it
    keeps none although asked to, why not (no budget, the model over the budget, no complete copy here)."""

    host_copy_bytes: int
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"hostCopyBytes": self.host_copy_bytes, **({"reason": self.reason} if self.reason else {})}

    @staticmethod
    def from_dict(doc: object) -> HostCopyAnswer:
        d = _obj(doc)
        n = d.get("hostCopyBytes")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise WireError("hostCopyBytes", f"must be an int >= 0, got {n!r}")
        why = d.get("reason")
        if why is not None and not isinstance(why, str):
            raise WireError("reason", f"must be a string or null, got {why!r}")
        return HostCopyAnswer(n, why)


@dataclass(frozen=True)
class ConvertRequest:
    """Convertible decoders (TokenScale): a decode engine accepts prefill (its own requests' and other
    decode engines' over its data port) with at most `prefill_chunk_tokens` prompt tokens per step, so its
    decodes keep their inter-token latency; None takes the conversion back (no cap). `step_budget_ms`
    (optional): besides the token cap, a step that decodes takes prompt tokens only while the engine's
    measured step cost predicts it within this time (the TBT objective's room); ignored without a cap.
    `hand_back_ms` (optional, ignored without a cap): a prompt the engine prefills itself that has made no
    prefill progress for this long, and has no token out yet, goes to the prefill engine its router named
    (PREFILL_FALLBACK_HEADER); None: the engine's default (kascade_engine.pd.handback.DEFAULT_HAND_BACK_S)."""

    prefill_chunk_tokens: int | None
    step_budget_ms: float | None = None
    hand_back_ms: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"prefillChunkTokens": self.prefill_chunk_tokens,
                **({"stepBudgetMs": self.step_budget_ms} if self.step_budget_ms is not None else {}),
                **({"handBackMs": self.hand_back_ms} if self.hand_back_ms is not None else {})}

    @staticmethod
    def from_dict(doc: object) -> ConvertRequest:
        d = _obj(doc)
        _only(d, ("prefillChunkTokens", "stepBudgetMs", "handBackMs"))
        if "prefillChunkTokens" not in d:
            raise WireError("prefillChunkTokens", "required (an int >= 1, or null to take the conversion back)")
        v = d["prefillChunkTokens"]
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise WireError("prefillChunkTokens", f"must be an int >= 1 or null, got {v!r}")
        ms = {k: _positive_ms(d, k) for k in ("stepBudgetMs", "handBackMs")}
        return ConvertRequest(v, ms["stepBudgetMs"], ms["handBackMs"])


def _positive_ms(d: Mapping[str, Any], key: str) -> float | None:
    ms = d.get(key)
    if ms is not None and (isinstance(ms, bool) or not isinstance(ms, (int, float)) or not 0 < ms < float("inf")):
        raise WireError(key, f"must be a number > 0 or null, got {ms!r}")
    return None if ms is None else float(ms)


class Phase(enum.StrEnum):
    """An engine's phase, as `GET status` reports it (its value): the engine sets it, the operator reads it."""

    EMPTY = "empty"  # started, bound to nothing (a warm-pool engine)
    BOUND = "bound"
    LOADING = "loading"
    LIVE = "live"  # loading and serving the loaded layers live (paired with an overloaded instance)
    SERVING = "serving"
    DRAINING = "draining"
    RELEASED = "released"

    @staticmethod
    def parse(value: object, where: str = "phase") -> Phase:
        """`value` as a Phase; ValueError naming `where` and the phases otherwise."""
        known = {p.value: p for p in Phase}
        if isinstance(value, str) and value in known:
            return known[value]
        raise ValueError(f"{where}: {value!r} is not an engine phase ({', '.join(known)})")


BUSY = frozenset({Phase.LOADING, Phase.LIVE, Phase.SERVING})  # bound and loading or holding the model


@dataclass(frozen=True)
class EngineStatus:
    """What `GET status` (and every control call) answers."""

    instance: str
    model: str
    phase: Phase
    role: str
    model_service: str | None
    blocks: Mapping[str, bool]
    bytes_received: int
    ready: bool
    cooperate: Mapping[str, str] | None = None
    load_error: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    extra: Mapping[str, Any] = field(default_factory=dict)  # counters a newer engine adds; kept, not read
    host_copy_bytes: int = 0  # a host copy of the model kept (after release, or while serving from it; 0: none)

    def to_dict(self) -> dict[str, Any]:
        return {"instance": self.instance, "model": self.model, "role": self.role, "modelService": self.model_service,
                "phase": self.phase.value, "blocks": dict(self.blocks), "bytesReceived": self.bytes_received,
                "ready": self.ready, "cooperate": dict(self.cooperate) if self.cooperate else None,
                "loadError": self.load_error, "device": self.device, "dtype": self.dtype, **self.extra,
                "hostCopyBytes": self.host_copy_bytes}

    @staticmethod
    def from_dict(doc: object) -> EngineStatus:
        d = dict(_obj(doc))
        known = ("instance", "model", "role", "modelService", "phase", "blocks", "bytesReceived", "ready",
                 "cooperate", "loadError", "device", "dtype", "hostCopyBytes")
        blocks = _obj(d.get("blocks") or {}, "blocks")
        return EngineStatus(str(d.get("instance", "")), str(d.get("model", "")), Phase.parse(d.get("phase")),
                            str(d.get("role", "")), d.get("modelService"), {str(k): bool(v) for k, v in blocks.items()},
                            int(d.get("bytesReceived") or 0), bool(d.get("ready")), d.get("cooperate"),
                            d.get("loadError"), str(d.get("device", "cpu")), str(d.get("dtype", "float32")),
                            {k: v for k, v in d.items() if k not in known}, int(d.get("hostCopyBytes") or 0))
