"""Autoscaling policies: pure functions from a metrics snapshot and the current state to a decision.

Data flow: `MetricsSnapshot` (rates and per-instance load, collected by the operator or the simulator)
+ `ScaleState` (current counts, bounds, the scale-down timer) -> policy -> `Decision` (desired count per
role, the reason with the numbers behind it, and the next state). Policies:
- `token_velocity` (TokenScale): prefillers = ceil(input-token rate / min(prefill, network velocity));
  decoders = Σ over (input, output)-length buckets of request rate / bucket velocity (the operator: one
  bucket of `MetricsSnapshot.decode_demand`, arrivals x the output length estimated from recent history);
  convertible decoders absorb a prefill burst before new prefillers arrive.
- `threshold` (BlitzScale): scale up when load per instance passes `upper`; scale down only after it
  stayed below `lower` for `scale_down_delay_s` (sub-second allowed).
- `concurrency` (AIBrix/Knative-like baseline): ceil(in-flight requests / target per instance).
Bounds always hold: min <= desired <= max, and at least one copy of the model stays somewhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from kascade_planner.outputlength import DecodeDemand, OutputLength, decode_demand
from kascade_planner.prefillvelocity import demand_weighted

# (prompt-length bucket, value) pairs: the engine's buckets ("128", "512", "2048", "inf"; kascade_engine.batch.velocity)
PromptBuckets = tuple[tuple[str, float], ...]

ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class Bucket:
    """Requests in one (input, output)-length bucket: arrival rate and what one decoder sustains."""

    requests_per_s: float
    decoder_velocity_rps: float


@dataclass(frozen=True)
class MeasuredVelocity:
    """Velocities the engines measured from their own step timings (one instance's, averaged over a role):
    prefill prompt tokens/s (kascade_planner.prefillvelocity: the slowest prompt-length bucket's capacity, from
    saturated steps; the best unsaturated step before any; in a snapshot, `weighted` by the arriving prompts'
    buckets),
    decode tokens/s one decoder sustains, and the KV link's tokens/s out of a prefiller. None: not measured."""

    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    network_tokens_per_s: float | None = None
    # prompt tokens/s actually prefilled while prompts waited (kascade_engine.batch.velocity's prefill rate): a
    # prefiller's velocity; a converted decoder's rate under its budgets (conversion.converted_share)
    prefill_rate_tokens_per_s: float | None = None
    # the prefill velocity of saturated steps alone (None until one: `prefill_tokens_per_s` is then the best
    # unsaturated step, a lower bound); the conversion policy's velocity (prefillvelocity.prefill_capacity)
    prefill_capacity_tokens_per_s: float | None = None
    # each prompt-length bucket's capacity (saturated steps; buckets without one left out), for `weighted`
    prefill_buckets: PromptBuckets = ()

    def weighted(self, demand: PromptBuckets) -> MeasuredVelocity:
        """Both prefill velocities weighted by the prompt tokens/s arriving per bucket
        (prefillvelocity.demand_weighted: sum d_b / sum d_b / v_b); no demand: unchanged."""
        cap, want = dict(self.prefill_buckets), dict(demand)
        return replace(self, prefill_tokens_per_s=demand_weighted(cap, want, self.prefill_tokens_per_s),
                       prefill_capacity_tokens_per_s=demand_weighted(cap, want, self.prefill_capacity_tokens_per_s))


@dataclass(frozen=True)
class MetricsSnapshot:
    time_s: float
    input_tokens_per_s: float = 0.0
    output_tokens_per_s: float = 0.0
    in_flight: int = 0
    kv_usage: float = 0.0  # mean fraction of KV cache used across instances
    buckets: tuple[Bucket, ...] = ()
    queue_length: float | None = None  # requests waiting (not yet admitted), summed; None: not measured
    ttft_s: float | None = None  # mean time to first token over the window (None: no request finished one)
    tbt_s: float | None = None  # mean time between tokens over the window
    measured: MeasuredVelocity | None = None  # the engines' own velocities (tokenVelocity without typed ones)
    decode_step_s: float | None = None  # mean decode-only step time over the window (a converted decoder's room)
    requests_per_s: float = 0.0  # requests arriving (kascade_requests_arrived) over the window
    output_length: OutputLength | None = None  # finished requests' output tokens (recent history)
    # prompt tokens/s arriving per prompt-length bucket (kascade_prompt_tokens_arrived_total{bucket}); the
    # operator's `measured` prefill velocities are already weighted by it (MeasuredVelocity.weighted)
    prompt_tokens_per_s_by_bucket: PromptBuckets = ()
    queue_tokens: float | None = None  # prompt tokens waiting (not yet admitted), summed; None: not measured

    @property
    def decode_demand(self) -> DecodeDemand:
        """max(measured output tokens/s, arriving requests/s x estimated output length):
        kascade_planner.outputlength.
        """
        return decode_demand(self.output_tokens_per_s, self.requests_per_s,
                             self.output_length.mean if self.output_length else None)


@dataclass(frozen=True)
class Bounds:
    min: int
    max: int

    def __post_init__(self) -> None:
        if self.min < 0 or self.max < max(1, self.min):
            raise ValueError(f"bounds need 0 <= min <= max and max >= 1, got min={self.min} max={self.max}")

    def clamp(self, n: int) -> int:
        return max(self.min, min(self.max, n))


@dataclass(frozen=True)
class ScaleState:
    role: str
    current: int
    bounds: Bounds
    host_cached: bool = False  # a complete host-memory copy exists (the parameter pool)
    below_since_s: float | None = None  # when load first dropped below the lower bound


@dataclass(frozen=True)
class Decision:
    role: str
    current: int
    desired: int
    reason: str
    metrics: tuple[tuple[str, float], ...]
    state: ScaleState
    extra: tuple[tuple[str, int], ...] = field(default=())  # e.g. convertible decoders to switch

    @property
    def change(self) -> int:
        return self.desired - self.current


def _keep_a_copy(state: ScaleState, n: int) -> tuple[int, str]:
    n = state.bounds.clamp(n)
    if n == 0 and not state.host_cached:
        return 1, " (kept 1: the last copy of the model is never released)"
    return n, ""


@dataclass(frozen=True)
class Slo:
    """Latency objectives (seconds). The token-velocity rule sizes for throughput; when the measured
    mean TTFT (prefill, colocated) or TBT (decode, colocated) over the window exceeds its objective,
    one more instance is asked for than the rule gives, until the latency is back within it."""

    ttft_s: float | None = None
    tbt_s: float | None = None


def slo_bump(m: MetricsSnapshot, state: ScaleState, desired: int, slo: Slo | None) -> tuple[int, str]:
    """`desired` raised to current + 1 when a measured latency misses its objective (within bounds)."""
    if slo is None:
        return desired, ""
    missed = []
    if slo.ttft_s is not None and m.ttft_s is not None and state.role != "decode" and m.ttft_s > slo.ttft_s:
        missed.append(f"TTFT {m.ttft_s * 1000:.0f} ms > SLO {slo.ttft_s * 1000:.0f} ms")
    if slo.tbt_s is not None and m.tbt_s is not None and state.role != "prefill" and m.tbt_s > slo.tbt_s:
        missed.append(f"TBT {m.tbt_s * 1000:.0f} ms > SLO {slo.tbt_s * 1000:.0f} ms")
    if not missed or state.current + 1 <= desired:
        return desired, ("; " + ", ".join(missed)) if missed else ""
    bumped = state.bounds.clamp(state.current + 1)
    return max(desired, bumped), "; " + ", ".join(missed) + f" -> {max(desired, bumped)}"


@dataclass(frozen=True)
class TokenVelocity:
    prefill_tokens_per_s: float  # one prefiller's prefill velocity
    network_tokens_per_s: float  # KV transfer velocity out of one prefiller
    headroom: float = 1.0  # > 1 provisions spare capacity

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.network_tokens_per_s <= 0 or self.headroom <= 0:
            raise ValueError("velocities and headroom must be > 0")


def token_velocity(m: MetricsSnapshot, state: ScaleState, v: TokenVelocity, idle_decoders: int = 0) -> Decision:
    """For role prefill: prefillers from the input-token rate. For decode/colocated: decoders from the
    bucketed request rates. `idle_decoders` convertible decoders can absorb a prefill deficit now."""
    if state.role == "prefill":
        velocity = min(v.prefill_tokens_per_s, v.network_tokens_per_s)
        need = math.ceil(m.input_tokens_per_s * v.headroom / velocity - 1e-9)
        desired, note = _keep_a_copy(state, need)
        convert = min(idle_decoders, max(0, desired - state.current))
        reason = (f"tokenVelocity: {m.input_tokens_per_s:.0f} input tok/s / min(prefill {v.prefill_tokens_per_s:.0f}, "
                  f"network {v.network_tokens_per_s:.0f}) -> {need} prefillers{note}")
        if convert:
            reason += f"; {convert} convertible decoder(s) prefill until new prefillers are ready"
        metrics = (("inputTokensPerSecond", m.input_tokens_per_s), ("velocity", velocity))
        return Decision(state.role, state.current, desired, reason, metrics, state, (("convertDecoders", convert),))
    need_f = sum(b.requests_per_s / b.decoder_velocity_rps for b in m.buckets if b.decoder_velocity_rps > 0)
    need = math.ceil(need_f * v.headroom - 1e-9)
    desired, note = _keep_a_copy(state, need)
    reason = f"tokenVelocity: Σ bucket rate/velocity = {need_f:.2f} -> {need} decoders{note}"
    return Decision(state.role, state.current, desired, reason, (("decoderDemand", need_f),), state)


@dataclass(frozen=True)
class Threshold:
    upper: float
    lower: float
    scale_down_delay_s: float = 0.5
    metric: str = "tokensPerSecond"  # or kvCacheUsage, or queueLength (requests waiting or in prefill per instance)
    # queueLength: also scale up when the prompt tokens waiting take longer than this to prefill at the current
    # instances' measured capacity (a count of requests ignores their length: 4 waiting 12k-token prompts are 16x
    # the work of 4 short ones). None: by count alone.
    queue_drain_s: float | None = None

    def __post_init__(self) -> None:
        if self.queue_drain_s is not None and not 0 < self.queue_drain_s < math.inf:
            raise ValueError(f"queue_drain_s must be a finite number > 0 or None, got {self.queue_drain_s}")
        if not 0 <= self.lower < self.upper:
            raise ValueError(f"need 0 <= lower < upper, got lower={self.lower} upper={self.upper}")
        if self.scale_down_delay_s < 0:
            raise ValueError("scale_down_delay_s must be >= 0")
        if self.metric not in ("tokensPerSecond", "kvCacheUsage", "queueLength"):
            raise ValueError(f"metric must be tokensPerSecond, kvCacheUsage or queueLength, got {self.metric!r}")


def threshold(m: MetricsSnapshot, state: ScaleState, p: Threshold) -> Decision:
    """`metric`: tokensPerSecond (input + output tokens/s per instance), queueLength (waiting requests
    per instance: `queue_length`, or `in_flight` where no waiting gauge exists, as in the simulator)
    or kvCacheUsage (mean fraction; one instance more or less per step)."""
    per_instance = p.metric != "kvCacheUsage"  # tokens/s and queue length are totals to divide
    if p.metric == "tokensPerSecond":
        total = m.input_tokens_per_s + m.output_tokens_per_s
    elif p.metric == "queueLength":
        total = m.queue_length if m.queue_length is not None else float(m.in_flight)
    else:
        total = m.kv_usage
    per = total / max(state.current, 1) if per_instance else total
    metrics = ((p.metric + "PerInstance", per), ("upper", p.upper), ("lower", p.lower))
    drain = _drain_decision(m, state, p)
    if drain is not None:
        return replace(drain, metrics=metrics + drain.metrics)
    if per > p.upper:
        # Enough instances to bring the load per instance back under the upper bound.
        need = math.ceil(total / p.upper) if per_instance else state.current + 1
        desired, note = _keep_a_copy(state, max(need, state.current + 1))
        reason = f"threshold: {per:.1f} per instance > upper {p.upper:g}{note}"
        return Decision(state.role, state.current, desired, reason, metrics, replace(state, below_since_s=None))
    if per < p.lower and state.current > 0:
        since = state.below_since_s if state.below_since_s is not None else m.time_s
        waited = m.time_s - since
        if waited >= p.scale_down_delay_s:
            desired, note = _keep_a_copy(state, state.current - 1)
            reason = f"threshold: {per:.1f} per instance < lower {p.lower:g} for {waited:.2f}s{note}"
            return Decision(state.role, state.current, desired, reason, metrics, replace(state, below_since_s=None))
        reason = f"threshold: below lower for {waited:.2f}s of {p.scale_down_delay_s:g}s"
        desired, _ = _keep_a_copy(state, state.current)
        return Decision(state.role, state.current, desired, reason, metrics, replace(state, below_since_s=since))
    if state.current == 0 and (total > 0 or m.in_flight > 0):
        # Scaled to zero and traffic arrived: no instance can carry it, whatever the per-instance load.
        desired, note = _keep_a_copy(state, max(1, math.ceil(total / p.upper) if per_instance else 1))
        return Decision(state.role, state.current, desired, f"threshold: traffic with no instance -> {desired}{note}",
                        metrics, replace(state, below_since_s=None))
    desired, note = _keep_a_copy(state, state.current)
    return Decision(state.role, state.current, desired, f"threshold: {per:.1f} per instance within bounds{note}",
                    metrics, replace(state, below_since_s=None))


def prefill_capacity(m: MetricsSnapshot) -> float | None:
    """One instance's measured prefill capacity in prompt tokens/s (saturated steps; else the best step seen)."""
    v = m.measured
    if v is None:
        return None
    return v.prefill_capacity_tokens_per_s or v.prefill_tokens_per_s


def _drain_decision(m: MetricsSnapshot, state: ScaleState, p: Threshold) -> Decision | None:
    """The queue bound in time (`Threshold.queue_drain_s`): a scale-up when the waiting prompt tokens take longer
    than the bound at the current instances' measured capacity, to ceil(tokens / (capacity x bound)) instances;
    None when it does not apply (another metric, no bound, nothing measured, or within the bound)."""
    cap = prefill_capacity(m)
    if p.metric != "queueLength" or p.queue_drain_s is None or not m.queue_tokens or not cap:
        return None
    drain = m.queue_tokens / (max(state.current, 1) * cap)
    if drain <= p.queue_drain_s:
        return None
    need = math.ceil(m.queue_tokens / (cap * p.queue_drain_s) - 1e-9)
    desired, note = _keep_a_copy(state, max(need, state.current + 1))
    reason = (f"threshold: {m.queue_tokens:.0f} prompt tokens waiting take {drain:.2f} s at {cap:.0f} tok/s per "
              f"instance > {p.queue_drain_s:g} s{note}")
    return Decision(state.role, state.current, desired, reason, (("queueDrainSeconds", drain),),
                    replace(state, below_since_s=None))


def prescale_decode(prefill: Decision, decode: Decision, decoders_per_prefiller: float) -> Decision:
    """BlitzScale §5: a prefill burst becomes a decode burst one prefill later, so when prefill scales
    up, decode scales with it (`decoders_per_prefiller` new decoders per new prefiller) instead of
    waiting for its KV usage to cross the bound. Never lowers what the decode policy wanted."""
    if decoders_per_prefiller < 0:
        raise ValueError(f"decoders_per_prefiller must be >= 0, got {decoders_per_prefiller}")
    if prefill.change <= 0:
        return decode
    extra = math.floor(
        prefill.change * decoders_per_prefiller + 1e-9
    )  # whole decoders only: +1 prefiller at 0.5 adds none
    want = decode.state.bounds.clamp(max(decode.desired, decode.current + extra))
    if want <= decode.desired:
        return decode
    reason = f"{decode.reason}; pre-scaled with prefill (+{prefill.change} prefill -> +{want - decode.current} decode)"
    return replace(decode, desired=want, reason=reason, state=replace(decode.state, below_since_s=None))


def concurrency(m: MetricsSnapshot, state: ScaleState, target_per_instance: int) -> Decision:
    if target_per_instance < 1:
        raise ValueError("target_per_instance must be >= 1")
    need = math.ceil(m.in_flight / target_per_instance)
    desired, note = _keep_a_copy(state, need)
    reason = f"concurrency: {m.in_flight} in flight / {target_per_instance} per instance -> {need}{note}"
    return Decision(state.role, state.current, desired, reason, (("inFlight", float(m.in_flight)),), state)
