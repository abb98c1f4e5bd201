"""Operator settings: one pydantic-settings object read from `KASCADE_OPERATOR_*` environment variables
(and CLI flags that override them).

Data flow: env / CLI -> `OperatorSettings` (validated, errors name the variable) -> handlers, metrics
collector, engine client, pool. Nothing reads the environment anywhere else.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kascade_planner.topology import LabelKeys

AF41 = 34  # DSCP "assured forwarding 4": the engine's default --activation-dscp (kascade_engine.net.transport.AF41)
# `kascade engine serve` flags a fallback pod (podtemplate.fallback_pod) and the chart's pool set from a setting or
# value of their own: engine_extra_args may not repeat them (the CLI would take the last one, silently); the
# chart refuses the same ones in pool.extraArgs (templates/validate.yaml; tests/chart checks both lists)
ENGINE_MANAGED_FLAGS = frozenset({
    "--empty", "--host", "--port", "--act-port", "--transport", "--activation-dscp", "--host-cache-gib",
    "--kv-tokens", "--max-prompt-tokens", "--max-seqs", "--max-batch-tokens", "--dtype", "--checkpoint",
    "--model-name", "--require-prefill-signature", "--tls-cert", "--tls-key", "--tls-ca", "--token-file", "--smollm",
    "--tp",
})
EXTRA_ARG = re.compile(r"^--[a-z0-9][a-z0-9-]*(=.*)?$")


class OperatorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KASCADE_OPERATOR_", extra="forbid")

    namespaces: list[str] = Field(default_factory=list, description="watched namespaces; empty = cluster-wide")
    pool_label: str = "kascade.io/pool"
    metrics_source: Literal["scrape", "prometheus"] = "scrape"
    prometheus_url: str | None = Field(default=None, pattern=r"^https?://")
    interval_seconds: float = Field(default=1.0, ge=0.05, le=3600, description="metric loop period (sub-second ok)")
    scrape_timeout_seconds: float = Field(default=0.5, gt=0, le=60)
    scrape_concurrency: int = Field(default=32, ge=1, le=4096,
                                    description="services' engines scraped at once by the shared metric sweep")
    resync_seconds: float = Field(default=10.0, gt=0, le=3600,
                                  description="a steady ModelService gets a round at least this often; rounds "
                                  "otherwise run when its metrics, pods, plans or spec change")
    round_workers: int = Field(default=8, ge=1, le=256, description="ModelService rounds run at once")
    rate_window_seconds: float = Field(default=1.0, ge=0, le=60,
                                       description="tokens/s over this sliding window of scrapes (0: last two)")
    load_watch_seconds: float = Field(default=10.0, ge=0, le=300,
                                      description="hold a long-poll on each serving engine's /metrics for up to "
                                      "this long, answered by the engine as soon as its prompt tokens/s over "
                                      "rate_window_seconds leaves +-25% (at least +-100 tokens/s) of the last "
                                      "reading; its service's round then runs without waiting for the sweep "
                                      "(0: off, crossings are seen by the sweep every interval_seconds)")
    engine_timeout_seconds: float = Field(default=2.0, gt=0, le=300)
    engine_token: str | None = Field(default=None, min_length=1, description="bearer token for the engine control API")
    engine_token_secret: str = Field(default="kascade-engine-token", min_length=1, description="Secret (key "
                                     "`token`) holding the engine control token when engine_token is not set; "
                                     "engine pods (the pool's, the fallback pods) reference it too")
    engine_token_namespace: str = Field(default="", description="namespace of engine_token_secret (default: the "
                                        "pod's namespace from POD_NAMESPACE, else 'default')")
    engine_token_create: bool = Field(default=False, description="create engine_token_secret with a random token "
                                      "when it is absent (the chart's default: a token that stays the same under "
                                      "`helm template`/GitOps rendering); false: wait for it, then fail")
    engine_tls_secret: str = Field(default="", description="Secret (tls.crt, tls.key, ca.crt) the fallback pods "
                                   "mount to serve the data plane over mutual TLS, as the chart's pool does when "
                                   "dataPlaneTls.secretName is set; empty = plain TCP")
    engine_transport: Literal["tcp", "ucx"] = Field(default="tcp", description="data-plane transport of the "
                                                     "fallback pods (engine --transport: weights, activations, "
                                                     "the KV of disaggregated serving), the pool's pool.transport: "
                                                     "engines reach only peers that speak the same one")
    engine_activation_dscp: int = Field(
        default=AF41,
        ge=0,
        le=63,
        description="DSCP the fallback pods' engines mark "
        "their activation connections and HTTP answers with (engine --activation-dscp), the pool's "
        "pool.activationDscp; 34 = AF41, 0 = no mark",
    )
    engine_host_cache_gib: float = Field(default=0.0, ge=0, le=1 << 20, description="host-memory budget (GiB) of "
                                         "the fallback pods' engines for a host copy of their model (engine "
                                         "--host-cache-gib), the pool's pool.hostCacheGiB; 0 = they keep none")
    engine_require_prefill_signature: bool = Field(default=False, description="the fallback pods' engines dial "
                                                   "only prefill peers a router signed with the engine token "
                                                   "(engine --require-prefill-signature), as the pool's do when "
                                                   "router.enabled and router.signPrefillPeers")
    engine_ucx_tcp_ports: str = Field(default="", pattern=r"^(\d{1,5}-\d{1,5})?$", description="UCX_TCP_PORT_RANGE "
                                      "(first-last) of the fallback pods with engine_transport ucx, the pool's "
                                      "pool.ucxTcpPorts (its NetworkPolicy admits that range); empty = UCX's default")
    engine_capacity: dict[str, int] = Field(default_factory=dict, description="the pool engines' capacity "
                                            "(chart pool.engine: kvTokens, maxPromptTokens, maxSeqs, "
                                            "maxBatchTokens), JSON; fallback pods get it where their "
                                            "ModelService's spec.engine.capacity sets nothing; empty = the "
                                            "engine's defaults")
    engine_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(default="auto", description="the "
                                                                           "fallback pods' engine --dtype, the "
                                                                           "pool's pool.engine.dtype")
    engine_resources: dict[str, dict[str, int | str]] = Field(default_factory=dict, description="container "
                                                              "resources (JSON) of fallback pods whose "
                                                              "ModelService sets no spec.engine.resources: the "
                                                              "pool's pool.resources (and GPU limit); empty = none")
    engine_extra_args: list[str] = Field(default_factory=list, description="further `kascade engine serve` flags "
                                         "of the fallback pods, after their own (JSON list; the chart's "
                                         "pool.extraArgs): each `--flag` or `--flag=value`, never one the "
                                         "operator sets itself (ENGINE_MANAGED_FLAGS)")
    engine_ca_file: str = Field(default="", description="PEM CA the engines' HTTP port certificates chain to: "
                                "with it the operator calls the control API and scrapes /metrics over HTTPS "
                                "(names not checked: engines are pod IPs), as engines started with TLS files "
                                "serve; the chart sets it to the dataPlaneTls Secret's ca.crt; empty = plain HTTP")
    engine_run_as_user: int = Field(default=65532, ge=1, le=2147483647, description="uid (and gid) the fallback "
                                    "pods' engines run as, non-root like the chart's pool (pool.runAsUser)")
    status_write_interval_seconds: float = Field(default=0.5, ge=0, description="throttle for ScalePlan progress")
    leaf_label: str = "kascade.io/leaf"
    domain_label: str = "kascade.io/scaleup-domain"
    nic_label: str = "kascade.io/nic-gbps"
    gpu_resource: str = "nvidia.com/gpu"
    inter_leaf_ratio: float = Field(default=1.0, gt=0, le=1)
    metrics_port: int = Field(default=0, ge=0, le=65535, description="operator's own /metrics; 0 = off")
    router_url: str | None = Field(default=None, pattern=r"^https?://",
                                   description="the router's base URL (in-cluster Service): ModelService status.url "
                                               "and demand per model when no engine exists (scale from zero)")
    router_demand_url: str | None = Field(default=None, pattern=r"^https?://",
                                          description="where to read demand from every router replica: a name that "
                                                      "resolves to each router pod (a headless Service); empty = "
                                                      "router_url")
    pool_namespace: str = Field(default="", description="namespace of the warm pool (and fallback pods) for "
                                "every ModelService; empty = each service's own namespace")
    allowed_host_path_roots: list[str] = Field(default_factory=list, description="directories under which a "
                                               "ModelService's spec.model.source.path may be mounted as a hostPath "
                                               "into a fallback pod; empty = none")
    hf_endpoint: str = Field(default="", pattern=r"^(https?://\S+)?$", description="HF_ENDPOINT of the fallback "
                             "pods the operator creates (a Hugging Face Hub mirror for hf:// sources); empty = "
                             "huggingface.co")
    hf_token_secret: str = Field(default="", description="Secret (key `token`) whose value fallback pods get as "
                                 "HF_TOKEN for hf:// sources (gated or private repos); empty = none")
    engine_image: str = Field(default="", description="the installation's engine image (always allowed)")
    allowed_images: list[str] = Field(default_factory=list, description="more images a ModelService's "
                                      "spec.engine.image may name; an entry ending in '*' is a prefix")
    engine_log_format: Literal["text", "json"] = Field(default="text", description="KASCADE_LOG_FORMAT of the "
                                                       "fallback engine pods the operator creates (the chart sets "
                                                       "it from logFormat, like its own pods)")
    host_copies_per_model: int = Field(default=1, ge=0, le=64, description="released engines that keep a model "
                                       "in host memory, per model (scale from zero binds one; a scale-up also sends "
                                       "from them as chain sources, kind host, while they stay released); more "
                                       "releases drop their weights, 0 keeps none (each engine's --host-cache-gib "
                                       "bounds its own). With node_cache: nodes that keep one, not engines")
    node_cache: bool = Field(default=False, description="the pool's engines share a node cache (chart "
                             "pool.nodeCache, engine --node-cache-dir): the engines of a node map its one copy of a "
                             "model, so host_copies_per_model counts nodes, and a release on a node whose copy is "
                             "counted keeps it")
    arbitration_hysteresis_seconds: float = Field(default=30.0, ge=0, le=86400, description="services sharing a "
                                                  "short pool: a replica bound more recently than this is not "
                                                  "preempted for another service (no oscillation)")
    arbitration_max_preemptions: int = Field(default=2, ge=0, le=64, description="replicas the fleet's arbitration "
                                             "may preempt in one arbitration (no pod storm); 0: never preempt")
    live_layer_seconds: float = Field(default=0.002, gt=0, le=10, description="a serving engine's time for one "
                                      "layer of one batch; with the plan's predicted seconds per block it gives a "
                                      "live pair's ZigZag loadRatio")
    live_zigzag_batches: int = Field(default=8, ge=1, le=1024, description="batches a live pair's ZigZag schedule "
                                     "plans ahead (the loading engine's first admissions follow it)")
    live_zigzag_ilp: bool = Field(default=False, description="live pairs follow the ZigZag ILP's prefixes instead "
                                  "of the ILP-free schedule's")
    leader_election: bool = Field(default=False, description="take part in leader election on a Lease; only the "
                                  "leader reconciles")
    lease_name: str = "kascade-operator"
    lease_namespace: str = Field(default="", description="namespace of the Lease (default: the pod's namespace "
                                 "from POD_NAMESPACE, else 'default')")
    lease_duration_seconds: float = Field(default=15.0, ge=2, le=300, description="whole seconds (the Lease's unit)")
    lease_renew_deadline_seconds: float = Field(default=10.0, gt=1, le=300)
    lease_retry_seconds: float = Field(default=2.0, ge=1, le=60)
    identity: str = Field(default="", description="this replica's name in the Lease (default: hostname + pid)")
    shards: int = Field(default=1, ge=1, le=256, description="replicas split the services into this many shards, "
                        "one Lease each (`<lease_name>-<k>`); a service's shard is a stable hash of its warm pool's "
                        "namespace mod shards (sharding.py). 1: one leader runs every service (the Lease "
                        "`<lease_name>`)")

    @model_validator(mode="after")
    def _capacity_keys(self) -> OperatorSettings:
        bad = {k: v for k, v in self.engine_capacity.items()
               if k not in ("kvTokens", "maxPromptTokens", "maxSeqs", "maxBatchTokens") or v < 1}
        if bad:
            raise ValueError(f"KASCADE_OPERATOR_ENGINE_CAPACITY: {bad} (keys kvTokens, maxPromptTokens, maxSeqs, "
                             "maxBatchTokens; values >= 1)")
        return self

    @model_validator(mode="after")
    def _extra_args(self) -> OperatorSettings:
        for i, a in enumerate(self.engine_extra_args):
            if not EXTRA_ARG.match(a):
                raise ValueError(f"KASCADE_OPERATOR_ENGINE_EXTRA_ARGS[{i}]: {a!r} is not --flag or --flag=value")
            if a.split("=", 1)[0] in ENGINE_MANAGED_FLAGS:
                raise ValueError(f"KASCADE_OPERATOR_ENGINE_EXTRA_ARGS[{i}]: {a.split('=', 1)[0]} is set by the "
                                 "operator from a setting of its own")
        return self

    @model_validator(mode="after")
    def _prometheus_needs_url(self) -> OperatorSettings:
        if self.metrics_source == "prometheus" and not self.prometheus_url:
            raise ValueError("KASCADE_OPERATOR_PROMETHEUS_URL is required when KASCADE_OPERATOR_METRICS_SOURCE "
                             "is prometheus")
        return self

    @model_validator(mode="after")
    def _tls_is_tcp_only(self) -> OperatorSettings:
        if self.engine_transport != "tcp" and self.engine_tls_secret:
            raise ValueError(f"KASCADE_OPERATOR_ENGINE_TRANSPORT {self.engine_transport} with "
                             "KASCADE_OPERATOR_ENGINE_TLS_SECRET: data-plane TLS is TCP-only (UCX does not encrypt)")
        return self

    @model_validator(mode="after")
    def _lease_timing(self) -> OperatorSettings:
        # the client's leader election needs lease > renew deadline > 1.2 x retry period
        if not self.lease_duration_seconds > self.lease_renew_deadline_seconds > 1.2 * self.lease_retry_seconds:
            raise ValueError("KASCADE_OPERATOR_LEASE_*: need lease duration > renew deadline > 1.2 x retry period "
                             f"(got {self.lease_duration_seconds}, {self.lease_renew_deadline_seconds}, "
                             f"{self.lease_retry_seconds})")
        return self

    @model_validator(mode="after")
    def _shards_need_pools(self) -> OperatorSettings:
        if self.shards > 1 and not self.leader_election:
            raise ValueError(f"KASCADE_OPERATOR_SHARDS {self.shards} needs KASCADE_OPERATOR_LEADER_ELECTION: "
                             "shards are held on Leases")
        if self.shards > 1 and self.pool_namespace:
            raise ValueError(f"KASCADE_OPERATOR_SHARDS {self.shards} with KASCADE_OPERATOR_POOL_NAMESPACE "
                             f"{self.pool_namespace!r}: every service shares that one pool (one fleet arbitration), "
                             "which one shard must own; shard with a pool per namespace")
        return self

    @property
    def label_keys(self) -> LabelKeys:
        return LabelKeys(self.leaf_label, self.domain_label, self.nic_label, self.gpu_resource)
