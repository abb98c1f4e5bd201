"""PD metrics: what disaggregated serving moved, in the engine's own registry (prefix `kascade_`).

  kascade_pd_prefills_served_total      prefill engine: prompts prefilled for decode engines
  kascade_pd_prefills_refused_total     prefill engine: prefill requests refused (bad input, not serving)
  kascade_pd_remote_prefills_total      decode engine: requests whose KV arrived from a prefill engine
  kascade_pd_local_fallbacks_total      decode engine: requests prefilled here after a remote prefill failed
  kascade_pd_handbacks_total            converted decoder: prompts it was prefilling itself that it handed to a
                                        prefill engine after its hand-back bound without progress (handback.py)
  kascade_kv_transfer_bytes_total{direction=sent|received}
  kascade_prefill_velocity_tokens_per_second{bucket}, kascade_decode_velocity_tokens_per_second{batch}
                                        measured prefill (saturated steps only: the capacity) / decode velocities
                                        (velocity.py; 0 = not yet measured)
  kascade_prefill_velocity_floor_tokens_per_second{bucket}  the best tokens/s of one unsaturated prefill step: the
                                        operator's prefill velocity until a saturated step is seen
  kascade_prefill_rate_tokens_per_second  prompt tokens/s actually prefilled while prompts waited (a converted
                                        decoder: under its budgets; velocity.py; 0 = not yet measured)
  kascade_kv_link_bytes_per_second{peer}  decode engine: KV bytes / seconds on the wire of the last transfer from
                                        each prefill peer (each kv frame from its header to its payload's last byte:
                                        P's compute between layers is not the link's); kascade_kv_link_tokens_per_second
                                        {peer} the same in prompt tokens/s: the pair's network velocity
Data flow: PrefillServer, RemotePrefill and HandBack count as they go; Prometheus (or the operator) scrapes /metrics.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from kascade_engine.batch.velocity import BATCH_BUCKETS, PROMPT_BUCKETS, VelocityMeter


class PDMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        lbl = ["model_name"]
        self.served = Counter("kascade_pd_prefills_served", "Prompts prefilled for decode engines", lbl,
                              registry=registry).labels(model_name)
        self.refused = Counter("kascade_pd_prefills_refused", "Prefill requests from decode engines refused", lbl,
                               registry=registry).labels(model_name)
        self.remote = Counter("kascade_pd_remote_prefills", "Requests whose KV arrived from a prefill engine", lbl,
                              registry=registry).labels(model_name)
        self.fallbacks = Counter("kascade_pd_local_fallbacks", "Requests prefilled locally after a remote prefill "
                                 "failed", lbl, registry=registry).labels(model_name)
        self.handbacks = Counter("kascade_pd_handbacks", "Prompts a converted decoder handed to a prefill engine "
                                 "after its hand-back bound without prefill progress", lbl,
                                 registry=registry).labels(model_name)
        self._bytes = Counter("kascade_kv_transfer_bytes", "KV bytes moved between prefill and decode engines",
                              ["model_name", "direction"], registry=registry)
        self.sent = self._bytes.labels(model_name, "sent")
        self.received = self._bytes.labels(model_name, "received")
        self._link = Gauge("kascade_kv_link_bytes_per_second", "KV bytes/s on the wire (per frame, header to last "
                           "payload byte) of the last transfer from a prefill peer",
                           ["model_name", "peer"], registry=registry)
        self._link_tokens = Gauge("kascade_kv_link_tokens_per_second", "Prompt tokens/s whose KV the last transfer "
                                  "from a prefill peer moved (TokenScale's network velocity)", ["model_name", "peer"],
                                  registry=registry)
        self.model_name = model_name

    def export_velocity(self, registry: CollectorRegistry, meter: Callable[[], VelocityMeter]) -> None:
        """Gauges read at scrape time from the current engine's meter (`meter()`: bind may rebuild it)."""
        pre = Gauge("kascade_prefill_velocity_tokens_per_second", "Prompt tokens/s this engine prefills when busy "
                    "(its capacity), measured from its saturated step timings, by prompt length bucket (le); 0 = no "
                    "saturated step yet", ["model_name", "bucket"], registry=registry)
        floor = Gauge("kascade_prefill_velocity_floor_tokens_per_second", "The best prompt tokens/s one unsaturated "
                      "prefill step of this engine delivered (a lower bound on its capacity), by prompt length bucket "
                      "(le)", ["model_name", "bucket"], registry=registry)
        dec = Gauge("kascade_decode_velocity_tokens_per_second", "Tokens/s this engine decodes, measured from its "
                    "step timings, by batch size bucket (le)", ["model_name", "batch"], registry=registry)
        rate = Gauge("kascade_prefill_rate_tokens_per_second", "Prompt tokens/s this engine actually prefilled over "
                     "its recent steps while prompts waited (a converted decoder: under its budgets), 0 = not measured",
                     ["model_name"], registry=registry)
        rate.labels(self.model_name).set_function(lambda: meter().prefill_rate() or 0.0)
        for b in [*map(str, PROMPT_BUCKETS), "inf"]:
            pre.labels(self.model_name, b).set_function(lambda b=b: meter().prefill.get(b, 0.0))  # type: ignore[misc]
            floor.labels(self.model_name, b).set_function(
                lambda b=b: meter().prefill_floor.get(b, 0.0))  # type: ignore[misc]
        for b in [*map(str, BATCH_BUCKETS), "inf"]:
            dec.labels(self.model_name, b).set_function(lambda b=b: meter().decode.get(b, 0.0))  # type: ignore[misc]

    def link(self, peer: str, bytes_per_s: float, tokens_per_s: float) -> None:
        self._link.labels(self.model_name, peer).set(bytes_per_s)
        self._link_tokens.labels(self.model_name, peer).set(tokens_per_s)
