"""Engine metrics (prometheus-client) in a registry owned by the engine instance (no module globals).

Names and labels follow vLLM's where the meaning is the same, with the `kascade_` prefix (so dashboards
built for vLLM port by changing the prefix): every serving metric carries `model_name`.
  kascade_num_requests_running / _waiting        gauges       kascade_kv_cache_usage_perc  gauge (0..1, pages)
  kascade_prompt_tokens_total / generation_tokens_total       kascade_num_preemptions_total
  kascade_request_success_total{finished_reason=stop|length|abort|error}
  kascade_request_generation_tokens (histogram: tokens each request that finished by stop or length generated)
  kascade_requests_arrived_total (requests accepted, counted where their prompt is: the operator's arrival
  rate; with the histogram, decode demand = arrivals x the recent mean output length, kascade_planner.outputlength)
  kascade_prompt_tokens_arrived_total{bucket="128|512|2048|inf"} (the same prompt tokens by the request's prompt
  length, velocity.py's buckets: the operator weights the per-bucket prefill velocities by this demand,
  kascade_planner.prefillvelocity.demand_weighted)
  kascade_time_to_first_token_seconds, kascade_inter_token_latency_seconds, kascade_e2e_request_latency_seconds
  kascade_request_queue_time_seconds, _prefill_time_seconds (prompts prefilled here: arrival -> first step ->
  first token), kascade_request_decode_time_seconds (first -> last token), kascade_request_prompt_tokens (histogram)
Kascade's own: blocks resident, weight transfer bytes and bandwidth, weight transfers that failed on this
engine (`kascade_weight_transfer_failures_total`, the transfer-failure alert), live-split requests and layers,
`kascade_data_port_bytes_total{transport,direction}`: payload bytes of the data port's connections
(activations, pairs, PD KV) as the transport (`--transport`: tcp, tcp+tls, ucx) counted them.
`kascade_step_seconds{kind=decode|mixed|prefill}` (step time by what it ran: the operator reads the decode
steps as a converted decoder's room for prefill), `kascade_prefill_step_tokens_max` (most prompt tokens one
step prefilled since the chunk budget last changed) and `kascade_prefill_chunk_budget_tokens`; a converted
decoder's time budget: `kascade_prefill_step_budget_seconds`, `kascade_prefill_tokens_cut_by_step_budget_total`
and the fitted `kascade_step_cost_prompt_token_seconds` (stepcost.py). Request redirection to a live replica
(liveredirect.py): `kascade_live_redirected_requests_total` and `kascade_live_redirect_taken_back_requests_total`
on the source, `kascade_live_redirect_received_requests_total` on the replica.

A released engine that switches model (`EngineInstance.switch_model`) calls `rename(new)`: every series labelled
with the old `model_name` (this module's, the PD metrics', the velocity gauges') moves to the new name, each
child with its value and callbacks (the attributes below keep counting, now under the new name; Prometheus
sees the old series end and the new one start, so `rate()` is unaffected).

Data flow: Serving calls `on_request` (prompt admitted), `observe_event` (every token), `observe_ttft`,
`on_finish`; `update(instance)` samples the gauges before a scrape and after every step.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from kascade_engine.batch.velocity import PROMPT_BUCKETS, bucket

MODEL_LABEL = "model_name"

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)  # vLLM's request_generation_tokens buckets


class EngineMetrics:
    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name
        r = self.registry = CollectorRegistry()
        lbl = ["model_name"]

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, lbl, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, lbl, registry=r).labels(model_name)

        def hist(name: str, doc: str) -> Any:
            return Histogram(name, doc, lbl, registry=r, buckets=LATENCY).labels(model_name)

        self.waiting = gauge("kascade_num_requests_waiting", "Requests waiting to be admitted")
        self.running = gauge("kascade_num_requests_running", "Requests in the running batch")
        self.kv_usage = gauge("kascade_kv_cache_usage_perc", "Fraction of KV cache pages in use (1 = full)")
        self.prompt_tokens = counter("kascade_prompt_tokens", "Prompt tokens accepted")
        self.prompt_total = 0.0  # the same count, read by a held load watch every tick (loadwatch.py)
        self.generation_tokens = counter("kascade_generation_tokens", "Tokens generated")
        self.preemptions = counter("kascade_num_preemptions", "Sequences preempted (pages ran out)")
        self.arrived = counter("kascade_requests_arrived", "Requests accepted (counted with their prompt tokens)")
        self._prompt_arrived = Counter("kascade_prompt_tokens_arrived", "Prompt tokens accepted, by the prompt-length "
                                       "bucket of their request (the prefill velocity's buckets)",
                                       ["model_name", "bucket"], registry=r)
        for b in (*map(str, PROMPT_BUCKETS), "inf"):  # every bucket from 0: a series appearing late loses a rate()
            self._prompt_arrived.labels(model_name, b)
        self.request_gen_tokens = Histogram("kascade_request_generation_tokens",
                                            "Tokens generated per request that finished (stop or length; an aborted "
                                            "request's output is cut short)", lbl, registry=r,
                                            buckets=TOKENS).labels(model_name)
        self._success = Counter("kascade_request_success", "Finished requests by finish reason",
                                ["model_name", "finished_reason"], registry=r)
        self.request_prompt_tokens = Histogram("kascade_request_prompt_tokens", "Prompt tokens per accepted request",
                                               lbl, registry=r, buckets=TOKENS).labels(model_name)
        self.queue_time = hist("kascade_request_queue_time_seconds",
                               "Arrival to the request's first step (prompts prefilled here)")
        self.prefill_time = hist("kascade_request_prefill_time_seconds",
                                 "First step to first token (prompts prefilled here)")
        self.decode_time = hist("kascade_request_decode_time_seconds",
                                "First token to last token (requests that finished by stop or length)")
        self.ttft = hist("kascade_time_to_first_token_seconds", "Time to first token")
        self.itl = hist("kascade_inter_token_latency_seconds", "Time between consecutive tokens of a request")
        self.e2e = hist("kascade_e2e_request_latency_seconds", "Arrival to last token")
        self.blocks_resident = Gauge("kascade_blocks_resident", "Weight blocks resident", registry=r)
        self.transfer_bytes = Gauge("kascade_transfer_bytes", "Weight bytes received by the data plane", registry=r)
        self.transfer_bw = Gauge("kascade_transfer_bandwidth_bytes_per_second",
                                 "Weight bytes received / seconds since the first byte of the current load", registry=r)
        self.transfer_failures = Counter("kascade_weight_transfer_failures",
                                         "Weight transfers (load plans) that failed on this engine", registry=r)
        self._transfer_failures_seen = 0
        self.shed = Counter("kascade_requests_shed", "Requests refused with 503 + Retry-After because the "
                            "waiting queue held --max-waiting-tokens prompt tokens", registry=r)
        self.live_split = Counter("kascade_live_split_requests", "Requests served split with a peer while loading",
                                  registry=r)
        self.live_layers = Gauge("kascade_live_layers", "Layers executed for a cooperating peer", registry=r)
        self.data_port_bytes = Counter("kascade_data_port_bytes", "Payload bytes the data port's connections "
                                       "(activations, live pairs, the KV of disaggregated serving) moved, counted "
                                       "by the transport that carried them", ["transport", "direction"], registry=r)
        self._data_port_seen = (0, 0)
        # steps by kind, and the prefill chunk budget at work: a converted decoder's mixed steps must stay short
        self.step_seconds = Histogram("kascade_step_seconds", "Engine step (one forward) duration by what it ran: "
                                      "decode (decodes only), mixed (decodes and prompt chunks), prefill (prompt "
                                      "chunks only)", ["model_name", "kind"], registry=r, buckets=LATENCY)
        self.prefill_step_max = gauge("kascade_prefill_step_tokens_max",
                                      "The most prompt tokens one step prefilled since the prefill chunk budget "
                                      "(a converted decoder's /convert) last changed")
        self.prefill_chunk_budget = gauge("kascade_prefill_chunk_budget_tokens",
                                          "The prefill chunk budget (prompt tokens per step) the last step ran "
                                          "under (a taken-back decoder's held one included); 0: no cap")
        self.prefill_step_budget = gauge(
            "kascade_prefill_step_budget_seconds",
            "The step time budget the last step ran under (a converted decoder: prompt "
            "chunks only while its measured step cost predicts the step within it); 0: none",
        )
        self.prefill_cut = counter("kascade_prefill_tokens_cut_by_step_budget",
                                   "Prompt tokens the step time budget held back from steps the token cap allowed")
        self.token_cost = gauge("kascade_step_cost_prompt_token_seconds",
                                "Seconds one more prompt token adds to a step, fitted online from this engine's "
                                "steps (stepcost.py); 0: not measured yet")
        # request redirection to a live replica (liveredirect.py): on the source, and on the replica (a pipeline head)
        self.redirected = counter("kascade_live_redirected_requests",
                                  "Queued requests this engine handed to a live replica (a pipeline head) to run")
        self.redirect_taken_back = counter("kascade_live_redirect_taken_back_requests",
                                           "Handed requests the live replica refused or dropped unfinished, queued "
                                           "here again")
        self.redirect_received = counter("kascade_live_redirect_received_requests",
                                         "Requests sources handed to this engine while it serves live")
        self._cut_seen = 0
        self._steps_seen = 0
        self._last_token: dict[str, float] = {}
        self._preemptions_seen = 0

    def rename(self, model_name: str) -> int:
        """The engine serves `model_name` now: its series move to that label (module docstring). Returns the
        series moved."""
        moved = relabel_model(self.registry, self.model_name, model_name)
        self.model_name = model_name
        return moved

    def on_request(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.prompt_total += prompt_tokens
        self.request_prompt_tokens.observe(prompt_tokens)
        self._prompt_arrived.labels(self.model_name, bucket(prompt_tokens, PROMPT_BUCKETS)).inc(prompt_tokens)
        self.arrived.inc()

    def observe_event(self, ev: Any, now: float) -> None:
        if ev.token < 0:
            self._last_token.pop(ev.request, None)
            return
        self.generation_tokens.inc()
        prev = self._last_token.get(ev.request)
        if prev is not None:
            self.itl.observe(now - prev)
        if ev.finished:
            self._last_token.pop(ev.request, None)
        else:
            self._last_token[ev.request] = now

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_phases(self, queued_s: float | None, ttft_s: float) -> None:
        """A prompt prefilled here (`queued_s` known): its queue time, and the rest of its TTFT as prefill time."""
        if queued_s is not None:
            self.queue_time.observe(queued_s)
            self.prefill_time.observe(max(0.0, ttft_s - queued_s))

    def on_finish(self, reason: str, seconds: float, generated: int = 0, decode_s: float | None = None) -> None:
        """`generated`: the tokens the request produced (its output length, when it finished by stop or length);
        `decode_s`: first token to last."""
        self._success.labels(self.model_name, reason).inc()
        self.e2e.observe(seconds)
        if reason in ("stop", "length"):
            self.request_gen_tokens.observe(generated)
            if decode_s is not None:
                self.decode_time.observe(decode_s)

    def update(self, inst: Any) -> None:
        s = inst.engine.scheduler
        self.waiting.set(len(s.waiting))
        self.running.set(len(s.running))
        self.kv_usage.set(s.kv_usage())
        eng = inst.engine
        rec = eng.recorder
        if eng.steps != self._steps_seen and rec.last_step is not None:
            self._steps_seen = eng.steps
            tokens, decodes, secs = rec.last_step
            kind = "mixed" if tokens and decodes else ("prefill" if tokens else "decode")
            self.step_seconds.labels(self.model_name, kind).observe(secs)
        self.prefill_step_max.set(rec.prefill_step_max)
        self.prefill_chunk_budget.set(s.last_cap or 0)
        self.prefill_step_budget.set(s.last_budget_s or 0)
        if s.cut_tokens > self._cut_seen:
            self.prefill_cut.inc(s.cut_tokens - self._cut_seen)
            self._cut_seen = s.cut_tokens
        self.token_cost.set(eng.cost.token_s or 0)
        if s.preemptions > self._preemptions_seen:
            self.preemptions.inc(s.preemptions - self._preemptions_seen)
            self._preemptions_seen = s.preemptions
        self.blocks_resident.set(len(inst.model.weights))
        self.transfer_bytes.set(inst.bytes_received)
        self.transfer_bw.set(inst.transfer_bw)
        if inst.transfer_failures > self._transfer_failures_seen:
            self.transfer_failures.inc(inst.transfer_failures - self._transfer_failures_seen)
            self._transfer_failures_seen = inst.transfer_failures
        self.live_layers.set(inst.finisher.layers_finished)
        t = inst.transport
        sent, received = t.traffic.sent, t.traffic.received
        self.data_port_bytes.labels(t.name, "sent").inc(sent - self._data_port_seen[0])
        self.data_port_bytes.labels(t.name, "received").inc(received - self._data_port_seen[1])
        self._data_port_seen = (sent, received)


def relabel_model(registry: CollectorRegistry, old: str, new: str) -> int:
    """Move every child of `registry` labelled `model_name=old` to `model_name=new`, keeping the child object (its
    value, a gauge's set_function, and every reference to it). prometheus_client has no public rename: this
    re-keys each labelled family's children under its lock (`_labelnames`, `_metrics`, `_lock`: stable since
    0.4; tests/engine/test_model_switch.py reads the real engine's /metrics after a switch)."""
    if old == new:
        return 0
    moved = 0
    families = {id(c): c for c in registry._collector_to_names}  # no public iterator of the collectors
    for c in families.values():
        if not isinstance(c, MetricWrapperBase):
            continue
        names = c._labelnames
        if MODEL_LABEL not in names:
            continue
        i = names.index(MODEL_LABEL)
        with c._lock:
            children = list(c._metrics.items())
            c._metrics.clear()
            for key, child in children:
                if key[i] == old:
                    key = (*key[:i], new, *key[i + 1:])
                    moved += 1
                c._metrics[key] = child
    return moved
