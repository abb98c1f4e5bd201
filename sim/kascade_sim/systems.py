"""The compared systems, each a configuration of the same simulator.

Data flow: a system name -> `System` (how weights reach a new instance, when it may serve, what host
memory it keeps) -> read by `simulator.Simulation`. All dynamic systems share one autoscaling policy,
so differences come only from the scale-up data path.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal


@dataclass(frozen=True)
class System:
    name: str
    transfer: Literal["chain", "binomial", "local"] = "chain"
    # "live": serve requests layer by layer while loading, paired with an overloaded source (ZigZag);
    # "pipeline": λScale execute-while-load across the receivers of one multicast;
    # "stop": serve only once every block arrived.
    serving: Literal["live", "pipeline", "stop"] = "stop"
    host_cache: Literal["one", "ttl", "all", "none"] = "none"
    keep_alive_s: float = 0.0  # ServerlessLLM host-cache keep-alive after the last instance on a host
    static: Literal["peak", "average"] | None = None
    pipeline_overhead: float = 0.2  # λScale: extra iteration time while the pipeline spans several GPUs
    # TokenScale's convertible decoders (disaggregated mode): the operator's conversion policy
    # (kascade_planner.conversion, every tick) converts decoders while prompt tokens/s exceed the
    # prefillers' velocity; a converted decoder prefills its own model's requests when no prefiller is
    # idle, and counts toward the prefill instances the threshold policy sees.
    convertible: bool = False
    # A converted prefill step stalls the decoder's running requests for its duration: while it has
    # any, at most this many prompt tokens per step (short prompts batched, longer ones chunked).
    # None: the conversion policy's chunk budget (half a TBT objective of prefill at the prefill velocity).
    convert_chunk_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.convert_chunk_tokens is not None and self.convert_chunk_tokens < 1:
            raise ValueError(f"system {self.name}: convert_chunk_tokens must be >= 1, got {self.convert_chunk_tokens}")
        if self.keep_alive_s < 0 or self.pipeline_overhead < 0:
            raise ValueError(f"system {self.name}: keep_alive_s and pipeline_overhead must be >= 0")


def system_presets() -> dict[str, System]:
    return {
        # Network multicast chains (GPU sources + one host copy: O(1) host cache) + live ZigZag, and
        # convertible decoders (Kascade is BlitzScale + λScale + TokenScale as one product).
        "kascade": System("kascade", "chain", "live", "one", convertible=True),
        # BlitzScale-like Kascade: the same data path without convertible decoders (the honest baseline for
        # what conversion adds).
        "kascade-noconv": System("kascade-noconv", "chain", "live", "one"),
        # ServerlessLLM: per-host memory cache with keep-alive (its default: 5 minutes after the last
        # instance of the model on the host), SSD on a miss, stop-the-world.
        "serverlessllm": System("serverlessllm", "local", "stop", "ttl", keep_alive_s=300.0),
        # AllCache: every host keeps the model in host memory (PCIe load), stop-the-world.
        "allcache": System("allcache", "local", "stop", "all"),
        # λScale-style: binomial-pipeline multicast from GPUs + execute-while-load pipelines.
        "lambdascale": System("lambdascale", "binomial", "pipeline", "one"),
        # DistServe/vLLM-style full provisioning (no scaling) at the peak and at the average demand.
        "static-peak": System("static-peak", static="peak"),
        "static-average": System("static-average", static="average"),
    }


def system(name: str, **overrides: object) -> System:
    presets = system_presets()
    if name not in presets:
        raise ValueError(f"unknown system {name!r} (choose {', '.join(presets)})")
    return replace(presets[name], **overrides) if overrides else presets[name]  # type: ignore[arg-type]


SYSTEM_NAMES = tuple(system_presets())
