"""Per-instance load collection: scrape engine `/metrics` directly or query Prometheus' HTTP API.

Data flow: engine endpoints -> Prometheus text (`kascade_*`, DESIGN §6) -> `parse_engine_metrics` ->
`InstanceSample` (cumulative counters + gauges) -> `RateTracker` turns two samples into per-second
rates -> `snapshot()` -> the planner's `MetricsSnapshot`, which the policies consume. The prefill velocity is
weighted there, in one place, by the prompt tokens/s arriving per prompt-length bucket
(`MeasuredVelocity.weighted`, kascade_planner.prefillvelocity.demand_weighted), over the bucket capacities
averaged across the role's instances. With
`metrics_source=prometheus` the same `InstanceLoad` values come from PromQL (rates computed there).
Parsing and rate math are pure; only `Scraper`/`PrometheusSource` do I/O.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import ClassVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kascade_operator.httppool import HttpPool
from kascade_operator.scrapeconn import ScrapeConns, ScrapeError
from kascade_planner.loadwatch import LoadWatch
from kascade_planner.outputlength import OutputLength
from kascade_planner.policies import MeasuredVelocity, MetricsSnapshot, PromptBuckets
from kascade_planner.prefillvelocity import prefill_capacity, prefill_velocity

log = logging.getLogger(__name__)


class MetricsError(RuntimeError):
    """A metrics source failed or returned something unusable; the message names source and metric."""


@dataclass(frozen=True)
class InstanceSample:
    """Raw values from one scrape: counters are cumulative."""

    time_s: float
    input_tokens: float = 0.0
    output_tokens: float = 0.0
    queue_length: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    ttft_sum: float = 0.0  # histogram sums and counts (cumulative)
    ttft_count: float = 0.0
    tbt_sum: float = 0.0
    tbt_count: float = 0.0
    decode_step_sum: float = 0.0  # kascade_step_seconds{kind="decode"} sum and count (cumulative)
    decode_step_count: float = 0.0
    velocity: MeasuredVelocity | None = None  # the engine's measured velocities (gauges, not rates)
    requests_arrived: float = 0.0  # kascade_requests_arrived (cumulative)
    gen_tokens_sum: float = 0.0  # kascade_request_generation_tokens sum and count: finished requests' output
    gen_tokens_count: float = 0.0
    prompt_arrived: PromptBuckets = ()  # kascade_prompt_tokens_arrived_total per prompt-length bucket (cumulative)


@dataclass(frozen=True)
class InstanceLoad:
    instance: str
    input_tokens_per_s: float
    output_tokens_per_s: float
    in_flight: int
    kv_usage: float
    queue_length: float = 0.0
    ttft_sum: float = 0.0  # over the window: latency seconds observed, and how many observations
    ttft_count: float = 0.0
    tbt_sum: float = 0.0
    tbt_count: float = 0.0
    velocity: MeasuredVelocity | None = None
    decode_step_sum: float = 0.0  # over the window: decode-only step seconds, and how many steps
    decode_step_count: float = 0.0
    requests_per_s: float = 0.0  # requests arriving over the window
    output_length: OutputLength | None = None  # finished requests' output tokens: the window's and the lifetime's
    prompt_tokens_per_s_by_bucket: PromptBuckets = ()  # prompt tokens arriving over the window, per length bucket


# vLLM-aligned engine metric names (kascade_ prefix; a `model_name` label, summed over here)
_GAUGES = {"kascade_num_requests_waiting": "queue_length", "kascade_num_requests_running": "running",
           "kascade_kv_cache_usage_perc": "kv_usage"}
_COUNTERS = {"kascade_prompt_tokens": "input_tokens", "kascade_generation_tokens": "output_tokens",
             "kascade_time_to_first_token_seconds_sum": "ttft_sum",
             "kascade_time_to_first_token_seconds_count": "ttft_count",
             "kascade_inter_token_latency_seconds_sum": "tbt_sum",
             "kascade_inter_token_latency_seconds_count": "tbt_count",
             "kascade_requests_arrived": "requests_arrived",
             "kascade_request_generation_tokens_sum": "gen_tokens_sum",
             "kascade_request_generation_tokens_count": "gen_tokens_count"}


# the engine's own velocities (kascade_engine.batch.velocity / remote_prefill): 0 or absent = not measured yet
_PREFILL_V, _DECODE_V, _LINK_V = ("kascade_prefill_velocity_tokens_per_second",
                                  "kascade_decode_velocity_tokens_per_second", "kascade_kv_link_tokens_per_second")
_RATE_V = "kascade_prefill_rate_tokens_per_second"  # prompt tokens/s actually prefilled (one gauge per engine)
# the best unsaturated prefill step's tokens/s per bucket: the prefill velocity until a saturated step is seen
_FLOOR_V = "kascade_prefill_velocity_floor_tokens_per_second"
# prompt tokens arriving per prompt-length bucket (kascade_engine.metrics): the demand the prefill velocity is
# weighted by; an engine without it (older) gives none, and the velocity is the one-velocity rule's
_ARRIVED = "kascade_prompt_tokens_arrived_total"


# the engine's step timings (kascade_engine.metrics): decode-only steps, the room a converted decoder has
_STEP = {"kascade_step_seconds_sum": "decode_step_sum", "kascade_step_seconds_count": "decode_step_count"}


def _velocity(v: Mapping[str, Sequence[float]], caps: Mapping[str, float]) -> MeasuredVelocity | None:
    """One engine's velocities from its gauges: the prefill velocity by kascade_planner.prefillvelocity's rule (the
    slowest bucket's capacity, the best floor before any saturated step) and each bucket's capacity (`caps`,
    bucket -> tokens/s), the best decode batch, the mean link."""
    pre = prefill_velocity(caps.values(), v.get(_FLOOR_V, []))
    dec, net, rate = ([x for x in v.get(k, []) if x > 0] for k in (_DECODE_V, _LINK_V, _RATE_V))
    if not (pre or dec or net or rate):
        return None
    return MeasuredVelocity(pre, max(dec) if dec else None,
                            sum(net) / len(net) if net else None, sum(rate) / len(rate) if rate else None,
                            prefill_capacity(caps.values()),
                            tuple(sorted((b, x) for b, x in caps.items() if x > 0)))


def parse_engine_metrics(text: str, time_s: float) -> InstanceSample:
    """Prometheus exposition text -> one sample (missing metrics read as 0; malformed text raises)."""
    values: dict[str, float] = {}
    vel: dict[str, list[float]] = {}
    caps: dict[str, float] = {}  # prefill capacity per prompt-length bucket
    arrived: dict[str, float] = {}  # prompt tokens arrived per prompt-length bucket (summed over model_name)
    try:
        for fam in text_string_to_metric_families(text):
            for smp in fam.samples:
                if smp.name == _PREFILL_V:
                    b = smp.labels.get("bucket", "")
                    caps[b] = max(caps.get(b, 0.0), float(smp.value))
                    continue
                if smp.name == _ARRIVED:
                    b = smp.labels.get("bucket", "")
                    arrived[b] = arrived.get(b, 0.0) + float(smp.value)
                    continue
                if smp.name in (_FLOOR_V, _DECODE_V, _LINK_V, _RATE_V):
                    vel.setdefault(smp.name, []).append(float(smp.value))
                    continue
                if smp.name in _STEP and smp.labels.get("kind") == "decode":
                    values[_STEP[smp.name]] = values.get(_STEP[smp.name], 0.0) + float(smp.value)
                    continue
                # counters appear as `<name>_total` (typed or, when the TYPE line names another family,
                # untyped); `_created` is a timestamp, not a value
                base = smp.name[:-6] if smp.name.endswith("_total") else smp.name
                field = _GAUGES.get(base) or _COUNTERS.get(base)
                if field is not None:
                    values[field] = values.get(field, 0.0) + float(smp.value)
    except ValueError as e:
        raise MetricsError(f"malformed Prometheus text: {e}") from None
    return InstanceSample(time_s, **values, velocity=_velocity(vel, caps),
                          prompt_arrived=tuple(sorted(arrived.items())))


_CUMULATIVE = tuple(f.name for f in fields(InstanceSample) if f.type == "float" and f.name not in
                    ("time_s", "queue_length", "running", "kv_usage"))


def _between(a: InstanceSample, b: InstanceSample, t: float) -> InstanceSample:
    """The cumulative counters at `t` (a.time_s <= t <= b.time_s), linear between two samples: a rate's base at
    exactly one window ago instead of the older sample (sweeps 1 s apart made a 1 s rate up to 2 s wide, and a
    crossing was seen up to that much later)."""
    f = (t - a.time_s) / (b.time_s - a.time_s)
    vals = {k: getattr(a, k) + f * (getattr(b, k) - getattr(a, k)) for k in _CUMULATIVE}
    was = dict(a.prompt_arrived)
    buckets = tuple((k, was.get(k, 0.0) + f * (x - was.get(k, 0.0))) for k, x in b.prompt_arrived)
    return InstanceSample(t, prompt_arrived=buckets, **vals)


class RateTracker:
    """Per-second rates from cumulative counters over a short sliding window per instance.

    `window_s` = 0 compares each sample with the previous one (fastest, noisiest); a window of about a
    second smooths the bursts a slow model produces (a request's prompt tokens all count at admission)
    so the policy neither scales down in the middle of a burst nor misses a calm. The base is the
    counters exactly `window_s` ago, linear between the samples either side of that time (or the oldest
    sample kept, when none is that old). A counter that went down was reset
    (engine restart): history is dropped and counting starts from zero.
    """

    def __init__(self, window_s: float = 0.0) -> None:
        if window_s < 0:
            raise ValueError(f"window_s must be >= 0, got {window_s}")
        self.window_s = window_s
        self._hist: dict[str, deque[InstanceSample]] = {}

    def update(self, instance: str, cur: InstanceSample) -> InstanceLoad:
        h = self._hist.setdefault(instance, deque())
        in_flight = int(cur.queue_length + cur.running)

        def load(base: InstanceSample | None, dt: float) -> InstanceLoad:
            """Rates and latency sums between `base` (None: from zero, after a reset) and `cur`."""
            zero = InstanceSample(cur.time_s)
            b = base or zero
            if dt <= 0:
                return InstanceLoad(instance, 0.0, 0.0, in_flight, cur.kv_usage, cur.queue_length,
                                    velocity=cur.velocity, output_length=OutputLength(
                                        0.0, 0.0, cur.gen_tokens_sum, cur.gen_tokens_count))
            length = OutputLength(cur.gen_tokens_sum - b.gen_tokens_sum, cur.gen_tokens_count - b.gen_tokens_count,
                                  cur.gen_tokens_sum, cur.gen_tokens_count)
            was = dict(b.prompt_arrived)
            by_bucket = tuple((k, (x - was.get(k, 0.0)) / dt) for k, x in cur.prompt_arrived)
            return InstanceLoad(instance, (cur.input_tokens - b.input_tokens) / dt,
                                (cur.output_tokens - b.output_tokens) / dt, in_flight, cur.kv_usage,
                                cur.queue_length, cur.ttft_sum - b.ttft_sum, cur.ttft_count - b.ttft_count,
                                cur.tbt_sum - b.tbt_sum, cur.tbt_count - b.tbt_count, cur.velocity,
                                cur.decode_step_sum - b.decode_step_sum, cur.decode_step_count - b.decode_step_count,
                                (cur.requests_arrived - b.requests_arrived) / dt, length, by_bucket)

        if h and (cur.input_tokens < h[-1].input_tokens or cur.output_tokens < h[-1].output_tokens
                  or cur.ttft_count < h[-1].ttft_count or cur.decode_step_count < h[-1].decode_step_count
                  or cur.requests_arrived < h[-1].requests_arrived or cur.gen_tokens_count < h[-1].gen_tokens_count
                  or any(x < dict(h[-1].prompt_arrived).get(k, 0.0) for k, x in cur.prompt_arrived)):
            prev = h[-1]
            h.clear()
            h.append(cur)
            return load(None, cur.time_s - prev.time_s)
        while len(h) >= 2 and h[1].time_s <= cur.time_s - self.window_s:
            h.popleft()
        base = h[0] if h else None
        if base is not None and len(h) >= 2 and base.time_s < cur.time_s - self.window_s:
            base = _between(base, h[1], cur.time_s - self.window_s)  # the counters exactly one window ago
        h.append(cur)
        if base is None or cur.time_s <= base.time_s:
            return load(None, 0.0)
        return load(base, cur.time_s - base.time_s)

    def forget(self, keep: Iterable[str]) -> None:
        keep_set = set(keep)
        for k in [k for k in self._hist if k not in keep_set]:
            del self._hist[k]


def _mean(xs: Iterable[float | None]) -> float | None:
    got = [x for x in xs if x is not None]
    return sum(got) / len(got) if got else None


def _summed(rows: Iterable[PromptBuckets], mean: bool = False) -> PromptBuckets:
    """Per-bucket sums (or means over the rows that have the bucket), sorted by bucket."""
    acc: dict[str, list[float]] = {}
    for row in rows:
        for k, x in row:
            acc.setdefault(k, []).append(x)
    return tuple(sorted((k, sum(xs) / len(xs) if mean else sum(xs)) for k, xs in acc.items()))


def measured(loads: Sequence[InstanceLoad]) -> MeasuredVelocity | None:
    """One instance's velocities, averaged over the instances that measured them (bucket capacities per bucket)."""
    vs = [x.velocity for x in loads if x.velocity is not None]
    if not vs:
        return None
    return MeasuredVelocity(_mean(v.prefill_tokens_per_s for v in vs), _mean(v.decode_tokens_per_s for v in vs),
                            _mean(v.network_tokens_per_s for v in vs), _mean(v.prefill_rate_tokens_per_s for v in vs),
                            _mean(v.prefill_capacity_tokens_per_s for v in vs),
                            _summed((v.prefill_buckets for v in vs), mean=True))


def pooled_length(loads: Sequence[InstanceLoad]) -> OutputLength | None:
    """The instances' finished requests pooled (their mean is over all their requests, not a mean of means)."""
    got = [x.output_length for x in loads if x.output_length is not None]
    return sum(got[1:], got[0]) if got else None


def snapshot(loads: Sequence[InstanceLoad], time_s: float) -> MetricsSnapshot:
    """Aggregate one model service's instances into the planner's snapshot (rates summed, KV averaged)."""
    if not loads:
        return MetricsSnapshot(time_s)
    # the prefill velocity weighted by the prompt tokens arriving per length bucket (no demand: unchanged)
    demand = _summed(x.prompt_tokens_per_s_by_bucket for x in loads)
    meas = measured(loads)
    ttft_n, tbt_n = sum(x.ttft_count for x in loads), sum(x.tbt_count for x in loads)
    step_n = sum(x.decode_step_count for x in loads)
    return MetricsSnapshot(time_s, input_tokens_per_s=sum(x.input_tokens_per_s for x in loads),
                           output_tokens_per_s=sum(x.output_tokens_per_s for x in loads),
                           queue_length=sum(x.queue_length for x in loads),
                           ttft_s=sum(x.ttft_sum for x in loads) / ttft_n if ttft_n > 0 else None,
                           tbt_s=sum(x.tbt_sum for x in loads) / tbt_n if tbt_n > 0 else None,
                           in_flight=sum(x.in_flight for x in loads),
                           kv_usage=sum(x.kv_usage for x in loads) / len(loads),
                           measured=meas.weighted(demand) if meas else None,
                           decode_step_s=sum(x.decode_step_sum for x in loads) / step_n if step_n > 0 else None,
                           requests_per_s=sum(x.requests_per_s for x in loads), output_length=pooled_length(loads),
                           prompt_tokens_per_s_by_bucket=demand)


class Scraper:
    """Direct scrape of engine `/metrics` (instance -> "host:port"), concurrently, with a timeout."""

    def __init__(self, timeout_s: float = 0.5, client: httpx.AsyncClient | None = None, window_s: float = 0.0,
                 tls: ssl.SSLContext | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """`tls`: engines serve HTTPS (engine_tls_context); None: plain HTTP. `clock`: when a scrape's counters
        were read (the rates divide by its differences); tests pass the clock their engine stubs count on."""
        self._http = HttpPool(timeout_s, client, tls)
        # the sweep's scrapes: a lean kept-alive GET per engine (scrapeconn.py: ~10x less CPU than httpx);
        # an injected client (tests' mock transports) is used as given
        self._conns = ScrapeConns(timeout_s, tls) if client is None else None
        self.window_s = window_s
        self.clock = clock
        # one tracker per group (a ModelService role): forgetting the instances a group no longer has
        # must not wipe another group's previous samples
        self.rates: dict[Hashable, RateTracker] = {}

        self._tls, self._timeout_s = tls, timeout_s
        self._watch_conns: ScrapeConns | None = None  # held load watches: a connection of their own per engine

    @property
    def can_watch(self) -> bool:
        """Load watches need the lean GET (an injected client, tests' mock transports, has none)."""
        return self._conns is not None

    async def watch(self, endpoint: str, watch: LoadWatch) -> str:
        """Hold `GET /metrics?<watch>` until the engine answers (its load left the band, or the wait is over):
        its /metrics text. Raises ScrapeError (an engine that is gone or slow, a refused query)."""
        if self._watch_conns is None:  # every phase may take the whole wait (the head comes when the band is left)
            self._watch_conns = ScrapeConns(watch.wait_s + self._timeout_s, self._tls)
        status, text = await self._watch_conns.get(endpoint, f"/metrics?{watch.to_query()}")
        if status != 200:
            raise ScrapeError(f"load watch: HTTP {status}: {text[:200]}")
        return text

    def load_of(self, group: Hashable, instance: str, text: str) -> InstanceLoad | None:
        """The instance's load from /metrics `text` read now (a load watch's answer), counted in the group's
        rates as a scrape is; None (logged) when the text does not parse."""
        try:
            sample = parse_engine_metrics(text, self.clock())
        except MetricsError as e:
            log.warning("load watch answer of %s: %s", instance, e)
            return None
        return self.rates.setdefault(group, RateTracker(self.window_s)).update(instance, sample)

    async def prune_watches(self, keep: Iterable[str]) -> None:
        if self._watch_conns is not None:
            await self._watch_conns.prune(keep)

    async def aclose(self) -> None:
        await self._http.aclose()
        if self._conns is not None:
            await self._conns.aclose()
        if self._watch_conns is not None:
            await self._watch_conns.aclose()

    async def _one(self, rates: RateTracker, instance: str, endpoint: str) -> InstanceLoad | None:
        try:
            if self._conns is not None:
                status, text = await self._conns.get(endpoint, "/metrics")
                if status != 200:
                    raise ScrapeError(f"HTTP {status}")
            else:
                r = await self._http.get(endpoint).get(self._http.url(endpoint, "/metrics"))
                r.raise_for_status()
                text = r.text
            return rates.update(instance, parse_engine_metrics(text, self.clock()))
        except (httpx.HTTPError, MetricsError, ScrapeError) as e:
            log.warning("scrape of %s (%s) failed: %s", instance, endpoint, e)
            return None

    async def collect(self, endpoints: Mapping[str, str], group: Hashable = None) -> list[InstanceLoad]:
        """Loads of the group's instances that answered (a failed scrape is logged and left out)."""
        rates = self.rates.setdefault(group, RateTracker(self.window_s))
        got = await asyncio.gather(*(self._one(rates, i, ep) for i, ep in endpoints.items()))
        rates.forget(endpoints)
        return [x for x in got if x is not None]


QUERY_LABEL = "kascade_query"  # tags each series of the combined query with its key


class PrometheusSource:
    """Per-instance load through PromQL on Prometheus' HTTP API (`/api/v1/query`).

    Engines are expected to be scraped by Prometheus with a `pod` label (the pod name)."""

    QUERIES: ClassVar[dict[str, str]] = {
        "input": 'sum by (pod) (rate(kascade_prompt_tokens_total{{pod=~"{pods}"}}[{window}]))',
        "output": 'sum by (pod) (rate(kascade_generation_tokens_total{{pod=~"{pods}"}}[{window}]))',
        "queue": 'sum by (pod) (kascade_num_requests_waiting{{pod=~"{pods}"}})',
        "running": 'sum by (pod) (kascade_num_requests_running{{pod=~"{pods}"}})',
        "kv": 'avg by (pod) (kascade_kv_cache_usage_perc{{pod=~"{pods}"}})',
        "ttft_sum": 'sum by (pod) (increase(kascade_time_to_first_token_seconds_sum{{pod=~"{pods}"}}[{window}]))',
        "ttft_count": 'sum by (pod) (increase(kascade_time_to_first_token_seconds_count{{pod=~"{pods}"}}[{window}]))',
        "tbt_sum": 'sum by (pod) (increase(kascade_inter_token_latency_seconds_sum{{pod=~"{pods}"}}[{window}]))',
        "tbt_count": 'sum by (pod) (increase(kascade_inter_token_latency_seconds_count{{pod=~"{pods}"}}[{window}]))',
        # decode-only steps: a converted decoder's chunk budget leaves their mean its time (as the Scraper)
        "step_sum": 'sum by (pod) (increase(kascade_step_seconds_sum{{pod=~"{pods}",kind="decode"}}[{window}]))',
        "step_count": 'sum by (pod) (increase(kascade_step_seconds_count{{pod=~"{pods}",kind="decode"}}[{window}]))',
        # arrivals and finished requests' output tokens (the output-length estimate: kascade_planner.outputlength),
        # over the window and since the engine started (the estimate when none finished in the window)
        "arrived": 'sum by (pod) (rate(kascade_requests_arrived_total{{pod=~"{pods}"}}[{window}]))',
        "gen_sum": 'sum by (pod) (increase(kascade_request_generation_tokens_sum{{pod=~"{pods}"}}[{window}]))',
        "gen_count": 'sum by (pod) (increase(kascade_request_generation_tokens_count{{pod=~"{pods}"}}[{window}]))',
        "gen_total_sum": 'sum by (pod) (kascade_request_generation_tokens_sum{{pod=~"{pods}"}})',
        "gen_total_count": 'sum by (pod) (kascade_request_generation_tokens_count{{pod=~"{pods}"}})',
        # prompt tokens arriving per prompt-length bucket: the demand the prefill velocity is weighted by
        "arrived_b": f'sum by (pod, bucket) (rate({_ARRIVED}{{{{pod=~"{{pods}}"}}}}[{{window}}]))',
        # the engine's measured velocities (gauges; 0 = not measured yet), reduced as the Scraper does
        # (`_velocity`): each prompt-length bucket's capacity (their min, else the best floor: the
        # one-velocity rule), the best decode batch, the mean KV link
        "prefill_v": f'max by (pod, bucket) ({_PREFILL_V}{{{{pod=~"{{pods}}"}}}} > 0)',
        "floor_v": f'max by (pod) ({_FLOOR_V}{{{{pod=~"{{pods}}"}}}} > 0)',
        "decode_v": f'max by (pod) ({_DECODE_V}{{{{pod=~"{{pods}}"}}}} > 0)',
        "link_v": f'avg by (pod) ({_LINK_V}{{{{pod=~"{{pods}}"}}}} > 0)',
        "rate_v": f'avg by (pod) ({_RATE_V}{{{{pod=~"{{pods}}"}}}} > 0)',
    }

    BY_BUCKET: ClassVar[frozenset[str]] = frozenset({"arrived_b", "prefill_v"})  # answered per (pod, bucket)

    def __init__(self, url: str, timeout_s: float = 1.0, window: str = "10s",
                 client: httpx.AsyncClient | None = None) -> None:
        self._url, self._window = url.rstrip("/"), window
        self._client = client or httpx.AsyncClient(timeout=httpx.Timeout(timeout_s))

    async def aclose(self) -> None:
        await self._client.aclose()

    def query(self, pods: Sequence[str]) -> str:
        """Every query of a collect in one PromQL expression, each series tagged with its key: Prometheus
        evaluates it at one instant over one view of its storage. Asked one by one, the queries straddled
        scrapes under load (18 requests over a second at load 20), and a snapshot's prompt tokens/s and its
        per-bucket split (two rates of counters incremented together) differed by 13 %."""
        sel = "|".join(pods)
        return " or ".join(f'label_replace({q.format(pods=sel, window=self._window)}, "{QUERY_LABEL}", "{k}", "", "")'
                           for k, q in self.QUERIES.items())

    async def _answer(self, q: str) -> dict[str, dict[str, dict[str, float]]]:
        """query key -> pod -> bucket label ("" when the query has none) -> value."""
        try:
            r = await self._client.post(f"{self._url}/api/v1/query", data={"query": q})
            doc = r.json()
        except (httpx.HTTPError, ValueError) as e:
            raise MetricsError(f"prometheus {self._url}: {e}") from None
        if r.status_code != 200 or doc.get("status") != "success":
            raise MetricsError(f"prometheus {self._url}: query {q[:200]!r} failed: {doc.get('error', r.text[:200])}")
        out: dict[str, dict[str, dict[str, float]]] = {k: {} for k in self.QUERIES}
        for row in doc.get("data", {}).get("result", []):
            labels = row.get("metric", {})
            key, pod = labels.get(QUERY_LABEL), labels.get("pod")
            if pod and key in out:
                out[key].setdefault(pod, {})[labels.get("bucket", "")] = float(row["value"][1])
        return out

    async def collect(self, pods: Sequence[str]) -> list[InstanceLoad]:
        if not pods:
            return []
        res = await self._answer(self.query(pods))
        per = {k: r for k, r in res.items() if k in self.BY_BUCKET}
        by = {k: {pod: sum(v.values()) for pod, v in r.items()} for k, r in res.items()}

        def velocity(p: str) -> MeasuredVelocity | None:
            caps = per["prefill_v"].get(p, {})
            pre = prefill_velocity(caps.values(), [by["floor_v"].get(p, 0.0)])
            v = MeasuredVelocity(pre, by["decode_v"].get(p), by["link_v"].get(p), by["rate_v"].get(p),
                                 prefill_capacity(caps.values()), tuple(sorted(caps.items())))
            return None if v == MeasuredVelocity() else v

        return [
            InstanceLoad(
                p,
                by["input"].get(p, 0.0),
                by["output"].get(p, 0.0),
                int(by["queue"].get(p, 0.0) + by["running"].get(p, 0.0)),
                by["kv"].get(p, 0.0),
                by["queue"].get(p, 0.0),
                by["ttft_sum"].get(p, 0.0),
                by["ttft_count"].get(p, 0.0),
                by["tbt_sum"].get(p, 0.0),
                by["tbt_count"].get(p, 0.0),
                velocity(p),
                decode_step_sum=by["step_sum"].get(p, 0.0),
                decode_step_count=by["step_count"].get(p, 0.0),
                requests_per_s=by["arrived"].get(p, 0.0),
                output_length=OutputLength(
                    by["gen_sum"].get(p, 0.0),
                    by["gen_count"].get(p, 0.0),
                    by["gen_total_sum"].get(p, 0.0),
                    by["gen_total_count"].get(p, 0.0),
                ),
                prompt_tokens_per_s_by_bucket=tuple(sorted(per["arrived_b"].get(p, {}).items())),
            )
            for p in pods
        ]
