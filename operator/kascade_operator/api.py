"""Pydantic mirror of the Kascade CRDs (`crds/`), used at the operator's boundary.

Data flow: a CR body from the API server -> `ModelService.model_validate(body)` -> typed spec for the
reconciler; status objects -> `model_dump(by_alias=True, exclude_none=True)` -> status patch. The CRD
schema is the source of truth; tests/api proves both accept and reject the same documents and declare
the same fields.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AliasGenerator, BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from kascade_planner.engine_api import MODEL_URI_PATTERN

Role = Literal["prefill", "decode", "colocated"]
Positive = Annotated[float, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]
IntOrString = int | str


class Model(BaseModel):
    # strict: the API server rejects "1" for an integer and "yes" for a boolean, so the mirror must too
    # (lax coercion would let a document through here that the CRD refuses).
    model_config = ConfigDict(alias_generator=AliasGenerator(alias=to_camel), populate_by_name=True,
                              extra="forbid", strict=True)


# --- ModelService -------------------------------------------------------------------------------
class PvcSource(Model):
    claim_name: str = Field(min_length=1)
    sub_path: str | None = None


class ModelSource(Model):
    path: str | None = Field(default=None, min_length=1)
    pvc: PvcSource | None = None
    uri: str | None = Field(default=None, min_length=1, pattern=MODEL_URI_PATTERN)

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelSource:
        if sum(x is not None for x in (self.path, self.pvc, self.uri)) != 1:
            raise ValueError("spec.model.source needs exactly one of path, pvc, uri")
        return self


class ModelRef(Model):
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")
    source: ModelSource
    layers: int | None = Field(default=None, ge=1, le=1024)
    dtype: Literal["bfloat16", "float16", "float32"] | None = None


class Resources(Model):
    limits: dict[str, IntOrString] | None = None
    requests: dict[str, IntOrString] | None = None


class Toleration(Model):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class EngineCapacity(Model):
    """spec.engine.capacity: engine serve flags fixed at pod start (kascade_operator.capacity)."""
    kv_tokens: int | None = Field(default=None, ge=1)
    max_prompt_tokens: int | None = Field(default=None, ge=1)
    max_seqs: int | None = Field(default=None, ge=1)
    max_batch_tokens: int | None = Field(default=None, ge=1)


class EngineSpec(Model):
    image: str = Field(min_length=1)
    capacity: EngineCapacity | None = None
    tp: int = Field(default=1, ge=1, le=64)
    # GPU memory one replica needs (fleettargets.py: pool engines on nodes whose GPUs hold less are not bound)
    gpu_memory_gib: float | None = Field(default=None, ge=0.001, le=1_000_000, alias="gpuMemoryGiB")
    port: int = Field(default=8000, ge=1, le=65535)
    data_port: int = Field(default=18515, ge=1, le=65535)
    resources: Resources | None = None
    node_selector: dict[str, str] | None = None
    tolerations: list[Toleration] | None = None


class RoleReplicas(Model):
    min: int = Field(ge=0)
    max: int = Field(ge=1, le=4096)
    desired: NonNegInt | None = None

    @model_validator(mode="after")
    def _min_le_max(self) -> RoleReplicas:
        if self.min > self.max:
            raise ValueError(f"min must be <= max (min={self.min}, max={self.max})")
        if self.desired is not None and not self.min <= self.desired <= self.max:
            raise ValueError(f"desired must lie within min..max (desired={self.desired}, min={self.min}, "
                             f"max={self.max})")
        return self


class Replicas(Model):
    desired: NonNegInt | None = None
    colocated: RoleReplicas | None = None
    prefill: RoleReplicas | None = None
    decode: RoleReplicas | None = None


class Slo(Model):
    # the TTFT objective; in disaggregated mode it also sets a converted decoder's hand-back bound (/convert
    # handBackMs = conversion.HAND_BACK_SHARE x ttftMs, docs/convertible.md)
    ttft_ms: Positive | None = None
    # the TBT objective; in disaggregated mode also a converted decoder's chunk and step budgets
    tbt_ms: Positive | None = None


class TokenVelocity(Model):
    prefill_tokens_per_second: Positive | None = None
    network_tokens_per_second: Positive | None = None
    decode_tokens_per_second: Positive | None = None


class Threshold(Model):
    metric: Literal["tokensPerSecond", "kvCacheUsage", "queueLength"] = "tokensPerSecond"
    upper: Positive
    lower: float = Field(ge=0)

    @model_validator(mode="after")
    def _lower_lt_upper(self) -> Threshold:
        if not self.lower < self.upper:
            raise ValueError(f"lower must be < upper (lower={self.lower}, upper={self.upper})")
        return self


class Concurrency(Model):
    target_per_instance: int = Field(ge=1)


class Scaling(Model):
    policy: Literal["tokenVelocity", "threshold", "concurrency"] = "tokenVelocity"
    interval_seconds: float = Field(default=1.0, ge=0.05, le=3600)
    scale_down_delay_seconds: float = Field(default=0.5, ge=0, le=86400)
    idle_release_seconds: float = Field(default=300.0, ge=0, le=604800)
    # priority class across services sharing one warm pool (higher first; kascade_planner.arbitration)
    priority: int = Field(default=0, ge=0, le=1_000_000_000)
    live: bool = True
    multicast: Literal["chain", "binomial", "star", "hybrid", "auto"] = "chain"
    token_velocity: TokenVelocity | None = None
    threshold: Threshold | None = None
    concurrency: Concurrency | None = None

    @model_validator(mode="after")
    def _policy_params(self) -> Scaling:
        if self.policy == "threshold" and self.threshold is None:
            raise ValueError("spec.scaling.threshold is required when policy is threshold")
        return self


class ModelServiceSpec(Model):
    model: ModelRef
    engine: EngineSpec
    mode: Literal["colocated", "disaggregated"] = "colocated"
    replicas: Replicas
    slo: Slo | None = None
    scaling: Scaling | None = None
    scale_plan_history_limit: int = Field(default=10, ge=0, le=1000)

    @model_validator(mode="after")
    def _roles_match_mode(self) -> ModelServiceSpec:
        r = self.replicas
        ok = r.colocated is not None if self.mode == "colocated" else (r.prefill is not None and r.decode is not None)
        if not ok:
            raise ValueError("spec.replicas must set colocated in colocated mode, and prefill and decode in "
                             "disaggregated mode")
        roles = [r.colocated] if self.mode == "colocated" else [r.prefill, r.decode]
        lo, hi = sum(x.min for x in roles if x), sum(x.max for x in roles if x)
        if r.desired is not None and not lo <= r.desired <= hi:
            raise ValueError(f"spec.replicas.desired must lie within min..max of the role (of prefill plus decode in "
                             f"disaggregated mode): desired={r.desired}, min={lo}, max={hi}")
        return self


class Condition(Model):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str | None = None
    message: str | None = None
    last_transition_time: str | None = None
    observed_generation: int | None = None


class RoleStatus(Model):
    desired: NonNegInt | None = None
    ready: NonNegInt | None = None
    loading: NonNegInt | None = None


class ReplicasStatus(Model):
    colocated: RoleStatus | None = None
    prefill: RoleStatus | None = None
    decode: RoleStatus | None = None


class PoolSource(Model):
    kind: Literal["gpu", "host"]
    location: str
    node: str | None = None
    blocks: NonNegInt | None = None


class Decision(Model):
    time: str | None = None
    policy: str | None = None
    role: Role | None = None
    from_: NonNegInt | None = Field(default=None, alias="from")
    to: NonNegInt | None = None
    reason: str | None = None
    metrics: dict[str, float] | None = None


class ArbitrationStatus(Model):
    asked: NonNegInt | None = None
    granted: NonNegInt | None = None
    priority: NonNegInt | None = None
    ranked_above: list[str] | None = None
    preempted: list[str] | None = None
    reason: str | None = None


class ModelServiceStatus(Model):
    observed_generation: int | None = None
    ready_replicas: NonNegInt | None = None
    loading_replicas: NonNegInt | None = None
    url: str | None = None
    selector: str | None = None
    active_plan: str | None = None
    replicas: ReplicasStatus | None = None
    sources: list[PoolSource] | None = None
    last_decision: Decision | None = None
    arbitration: ArbitrationStatus | None = None
    conditions: list[Condition] | None = None


class ModelService(Model):
    api_version: str | None = None
    kind: str | None = None
    metadata: dict[str, Any] | None = None
    spec: ModelServiceSpec
    status: ModelServiceStatus | None = None


# --- ScalePlan ----------------------------------------------------------------------------------
class ModelServiceRef(Model):
    name: str = Field(min_length=1)


class PlanSource(Model):
    instance: str = Field(min_length=1)
    pod: str | None = None
    node: str | None = None
    gpus: list[NonNegInt] | None = None
    kind: Literal["gpu", "host"] | None = None
    path: str | None = Field(default=None, min_length=1)
    host_copy: bool | None = None


class PlanTarget(Model):
    instance: str = Field(min_length=1)
    pod: str | None = None
    node: str | None = None
    gpus: list[NonNegInt] | None = None
    predicted_seconds: float | None = Field(default=None, ge=0)
    node_copy: bool | None = None  # loads from its node's cache (bind source.nodeCopy), in no flow of the plan


class Shard(Model):
    source: str
    target: str
    index: NonNegInt
    count: int = Field(ge=1)

    @model_validator(mode="after")
    def _index_lt_count(self) -> Shard:
        if self.index >= self.count:
            raise ValueError(f"index must be < count (index={self.index}, count={self.count})")
        return self


class LivePair(Model):
    overloaded: str
    loading: str


class ScalePlanSpec(Model):
    model_service_ref: ModelServiceRef
    role: Role
    algorithm: Literal["chain", "binomial", "hybrid", "star", "tree", "local"]
    reason: str | None = Field(default=None, max_length=4096)
    sources: list[PlanSource] = Field(min_length=1)
    targets: list[PlanTarget] = Field(min_length=1)
    chains: list[Annotated[list[str], Field(min_length=2)]] | None = None
    shards: list[Shard] | None = None
    live_pairs: list[LivePair] | None = None
    block_order: list[str] | None = None
    predicted_seconds: float | None = Field(default=None, ge=0)
    dtype: Literal["bfloat16", "float16", "float32"] | None = None
    plan: dict[str, Any] | None = None


class TargetProgress(Model):
    instance: str
    blocks_received: NonNegInt | None = None
    blocks_total: NonNegInt | None = None
    bytes_received: NonNegInt | None = None
    ready: bool | None = None
    instructed: bool | None = None
    failed: str | None = None


class ScalePlanStatus(Model):
    phase: Literal["Pending", "Transferring", "Live", "Succeeded", "Failed"] | None = None
    observed_generation: int | None = None
    start_time: str | None = None
    completion_time: str | None = None
    targets_ready: str | None = None
    progress: str | None = None
    targets: list[TargetProgress] | None = None
    duration_seconds: float | None = Field(default=None, ge=0)
    bandwidth_gbps: float | None = Field(default=None, ge=0)
    replans: NonNegInt | None = None
    message: str | None = None
    conditions: list[Condition] | None = None


class ScalePlan(Model):
    api_version: str | None = None
    kind: str | None = None
    metadata: dict[str, Any] | None = None
    spec: ScalePlanSpec
    status: ScalePlanStatus | None = None
