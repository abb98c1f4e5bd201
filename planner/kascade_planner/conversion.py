"""Convertible decoders (TokenScale): which decode instances take prefill during a prefill burst, with
what chunk budget, and when they give it back.

Data flow: `ConversionInput` (the prompt tokens/s arriving, ready prefillers and one prefiller's
velocity, the prefill queue, the service's decoders with their current conversion, the TBT objective)
-> `plan_conversions` -> `Conversions` (decoders to convert, decoders to take back, the chunk budget,
the reason with the numbers). The operator applies it (kascade_operator.converter): the engine's
`/convert` call sets the budget, the pod annotation `kascade.io/convertible` makes the router send it
prefill.

The rule:
- prefill capacity = ready prefillers x velocity; a converted decoder adds its measured share of a prefiller
  (`converted_share`: the prompt tokens/s converted decoders actually prefilled over a prefiller's, both from
  their own steps, kascade_engine.batch.velocity), `CONVERTED_SHARE` until measured (its chunk budget spends at most
  that share of each TBT on prefill). Measured on 2 shared CPU cores it was 7-45 %, not 50 %: a fixed half
  under-converted, and the router sent the decoder prompts it could not finish (bench/pd.py; ADR 0010);
- deficit = prompt tokens/s arriving - prefill capacity. While it is > 0, enough decoders are converted
  to cover it (least loaded first, then by name), never fewer than already are;
- all of them are taken back when the deficit is gone (the new prefillers the ratio policy asked for
  are live, or the burst ended) and no prompt waits at a prefiller: no partial take-back, so a rate
  that jitters around the capacity does not flap conversions;
- chunk budget = the prefill time a step may add x prefill velocity tokens, within [MIN_CHUNK, MAX_CHUNK];
  DEFAULT_CHUNK without an objective or a velocity (the simulator's default too). The time is
  `CONVERTED_SHARE` x the TBT objective (a chunk prefills in half a TBT), and no more than what the
  decoders' measured decode step leaves of the objective (`decode_step_s`): a step that mixes a chunk
  into the decodes takes the decodes' time PLUS the chunk's, so on an engine whose decode step already
  takes more than half the objective (a compute-bound CPU decoder with a full batch) half a TBT of
  prefill would push every token of the batch past the objective. Without a measured decode step the
  budget is the half-TBT one.
- step budget = `STEP_BUDGET_SHARE` x the TBT objective (None without one): the time a converted decoder's
  step that decodes may take with its prompt chunk, as the engine's own measured step cost predicts it
  (kascade_engine.batch.stepcost). The token budget above assumes a chunk costs its tokens / velocity on top of a
  mean decode step; on a CPU engine a chunk costs more than that and the decode step grows with the batch's
  context, so the engine cuts each chunk to the time its step has left (measured, bench/pd.py).
- hand-back bound = `HAND_BACK_SHARE` x the TTFT objective (None without one: the engine's default): how long a
  converted decoder lets a prompt it prefills itself go without progress (or at a pace the prefill engine
  would beat) before it hands the prompt to a prefill engine (kascade_engine.pd.handback). A quarter of the
  objective leaves the remote path three quarters of it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

CONVERTED_SHARE = 0.5  # a converted decoder spends at most this share of its step time on prefill
MIN_SHARE = 0.01  # a measured share is never taken below this (a rate near 0 would make a decoder's cost infinite)
MIN_CHUNK, MAX_CHUNK, DEFAULT_CHUNK = 8, 2048, 256
# a converted decoder's decoding step, chunk included, is predicted within this share of the TBT objective:
# the rest is for what a token meets between steps (event delivery, the router's hop) and the prediction's error
STEP_BUDGET_SHARE = 0.8
# a converted decoder checks a prompt it prefills itself every this share of the TTFT objective (hand-back bound)
HAND_BACK_SHARE = 0.25


@dataclass(frozen=True)
class DecoderView:
    name: str
    converted: bool  # it takes prefill now (annotation kascade.io/convertible=true)
    in_flight: int = 0  # requests on it: the least loaded convert first


@dataclass(frozen=True)
class ConversionInput:
    input_tokens_per_s: float  # prompt tokens/s arriving at the service
    prefill_ready: int  # prefill instances serving
    prefill_tokens_per_s: float | None  # one prefiller's velocity (min of compute and KV link); None: unknown
    decoders: tuple[DecoderView, ...]  # the service's serving decoders (not draining)
    prefill_queue: float | None = None  # requests waiting at prefillers; None: not measured
    tbt_slo_s: float | None = None
    decode_step_s: float | None = None  # the decoders' mean decode-only step time now; None: not measured
    ttft_slo_s: float | None = None  # the TTFT objective (spec.slo.ttftMs); None: none
    # a converted decoder's measured share of a prefiller (`converted_share`); None: not measured, CONVERTED_SHARE
    converted_share: float | None = None

    def __post_init__(self) -> None:
        if self.input_tokens_per_s < 0 or self.prefill_ready < 0:
            raise ValueError(f"input_tokens_per_s and prefill_ready must be >= 0, got {self.input_tokens_per_s}, "
                             f"{self.prefill_ready}")
        if self.prefill_tokens_per_s is not None and not self.prefill_tokens_per_s > 0:
            raise ValueError(f"prefill_tokens_per_s must be > 0 or None, got {self.prefill_tokens_per_s}")
        if self.tbt_slo_s is not None and not self.tbt_slo_s > 0:
            raise ValueError(f"tbt_slo_s must be > 0 or None, got {self.tbt_slo_s}")
        if self.ttft_slo_s is not None and not self.ttft_slo_s > 0:
            raise ValueError(f"ttft_slo_s must be > 0 or None, got {self.ttft_slo_s}")
        if self.decode_step_s is not None and not self.decode_step_s >= 0:
            raise ValueError(f"decode_step_s must be >= 0 or None, got {self.decode_step_s}")
        if self.converted_share is not None and not 0 < self.converted_share <= 1:
            raise ValueError(f"converted_share must be in (0, 1] or None, got {self.converted_share}")


@dataclass(frozen=True)
class Conversions:
    convert: tuple[str, ...]  # decoders to convert now
    revert: tuple[str, ...]  # converted decoders to take back now
    chunk_tokens: int  # the prefill chunk budget a converted decoder gets
    converted: int  # converted decoders after this round
    reason: str
    step_budget_s: float | None = None  # a converted decoder's step time budget (None: no TBT objective)
    hand_back_s: float | None = None  # a converted decoder's hand-back bound (None: no TTFT objective)

    @property
    def changes(self) -> bool:
        return bool(self.convert or self.revert)


def converted_share(decoder_rate: float | None, prefill_rate: float | None) -> float:
    """How much of a prefill engine a converted decoder is: the prompt tokens/s it actually prefilled under its
    budgets over the prompt tokens/s a prefill engine did (both measured from their own steps), within
    [MIN_SHARE, 1]; `CONVERTED_SHARE` while either is unmeasured (None; a prefill rate of 0 too). A decoder rate
    of 0 is measured: its budgets gave waiting prompts nothing. The router ranks a converted decoder's prompts by
    it (kascade_router.balancer) and the policy sizes conversions by it."""
    for name, v in (("decoder_rate", decoder_rate), ("prefill_rate", prefill_rate)):
        if v is not None and not 0 <= v < math.inf:
            raise ValueError(f"{name} must be a finite number >= 0 or None, got {v}")
    if decoder_rate is None or not prefill_rate:
        return CONVERTED_SHARE
    return min(1.0, max(MIN_SHARE, decoder_rate / prefill_rate))


def chunk_budget(tbt_slo_s: float | None, prefill_tokens_per_s: float | None,
                 decode_step_s: float | None = None) -> int:
    """Prompt tokens per step a converted decoder may prefill so its decodes keep the TBT objective: the
    step's prefill time is half the objective at most, and at most what the decode step leaves of it."""
    if tbt_slo_s is None or prefill_tokens_per_s is None:
        return DEFAULT_CHUNK
    room = CONVERTED_SHARE * tbt_slo_s
    if decode_step_s is not None:
        room = min(room, tbt_slo_s - decode_step_s)
    return max(MIN_CHUNK, min(MAX_CHUNK, math.floor(max(room, 0.0) * prefill_tokens_per_s)))


def step_budget(tbt_slo_s: float | None) -> float | None:
    """The time a converted decoder's step that decodes may take, its prompt chunk included."""
    return None if tbt_slo_s is None else STEP_BUDGET_SHARE * tbt_slo_s


def hand_back(ttft_slo_s: float | None) -> float | None:
    """How long a converted decoder lets a prompt it prefills itself lag before handing it to a prefill engine."""
    return None if ttft_slo_s is None else HAND_BACK_SHARE * ttft_slo_s


def remote_prefill_s(took_s: float | None, waited_s: Iterable[float], queued_tokens: int = 0,
                     pace: float | None = None) -> float | None:
    """What a prompt sent to a prefill engine now is expected to take there, start to KV landed (`arrival_verdict`'s
    and `hand_back_verdict`'s `remote_s`). None: nothing measured.

    - `took_s`: the moving average of recent remote prefills (queue, compute and link; None: none landed yet);
    - `waited_s`: how long each prompt the caller sent there and has not got back has waited so far;
    - `queued_tokens`: their prompt tokens plus the new prompt's (each counted whole: how far the prefill engine got
      with one is not known before its KV lands);
    - `pace`: the prefill engine's measured prefill rate in prompt tokens/s (its own meter,
    kascade_engine.batch.velocity;
      None: not known).

    The estimate is the oldest wait PLUS `queued_tokens` at `pace`: a prompt sent now waits for everything queued
    before it, and the oldest wait stands for what is ahead of the caller's prompts that the caller cannot see
    (other decoders' prompts at the same prefill engine, the engine's own batch). Never less than `took_s`. The
    average is a floor, not an addend: it already holds a prompt's own compute, and added to the new prompt's it
    would count it twice. Without `pace` (tokens cannot become seconds) it is the old estimate, the longer of the
    average and the oldest wait, which ignores the queue ahead of the new prompt: in a burst it said 0.3 s while
    8 long prompts were queued ahead (bench/pd.py), so decoders declined prompts they would
    have finished sooner. The engine (kascade_engine.pd.remote_prefill) and the simulator (kascade_sim.serving) both
    estimate by it."""
    waits = list(waited_s)
    if queued_tokens < 0:
        raise ValueError(f"queued_tokens must be >= 0, got {queued_tokens}")
    if pace is not None and not 0 < pace < math.inf:
        raise ValueError(f"pace must be a finite number > 0 or None, got {pace}")
    oldest = max(waits, default=0.0)
    if pace is None or not queued_tokens:
        return None if took_s is None and not waits else max(took_s or 0.0, oldest)
    return max(took_s or 0.0, oldest + queued_tokens / pace)


def hand_back_verdict(left: int, progressed: int, elapsed_s: float, remote_s: float | None) -> str | None:
    """Why a prompt a converted decoder prefills itself should go to a prefill engine now (None: it stays).
    `left`: its prompt tokens not yet computed there; `progressed`: tokens computed over the last `elapsed_s`;
    `remote_s`: what a prefill of the whole prompt on a prefill engine is expected to take, queue included (None:
    not measured). No progress always hands back; progress hands back when the remote path finishes sooner. The
    engine (kascade_engine.pd.handback) and the simulator (kascade_sim.serving) both decide by it."""
    if progressed <= 0:
        return f"no prefill progress for {elapsed_s:.3f} s"
    if elapsed_s <= 0:
        return None
    return _slower(left, progressed / elapsed_s, remote_s, f"{progressed} tokens in {elapsed_s:.3f} s")


def arrival_verdict(prompt_tokens: int, rate: float | None, remote_s: float | None, decodes: int,
                    new_prefiller_s: float | None = None) -> str | None:
    """Why a converted decoder should hand a prompt it was sent to prefill itself to a prefill engine at once, as it
    arrives (None: it starts it). `hand_back_verdict` with the prefill rate the decoder measured over its recent steps
    (kascade_engine.batch.velocity: what its budgets gave or would give a prompt beside its decodes) in place of the
    progress it has not seen yet: a rate of 0 hands back, a rate whose predicted finish is later than the remote
    path's hands back. Without a measured rate (`rate` None: just converted, its warm-up not done) it cannot predict
    a finish at all and hands back too: the prefill engine is the path that serves prompts when nothing says a
    converted decoder would do better. The router ranked a just-converted decoder at the constant share and sent
    it 1-2 burst prompts it held for the whole hand-back bound (bench/pd.py). `decodes`: the
    sequences it decodes now (and those about to join); with none it starts the prompt whatever its rate says, since
    its step budget binds only beside decodes (an idle decoder gives a prompt its whole chunk cap every step), and
    an idle engine steps no more, so its last rate is as old as its last busy step.
    `new_prefiller_s`: what a prefill engine started now would take for the prompt, its load included
    (`new_prefill_s`; None: none can be started): the prompt is declined when that path finishes first too,
    so a decoder never chunk-prefills a prompt that waiting for a new prefiller would serve sooner."""
    if prompt_tokens < 1 or decodes < 0:
        raise ValueError(f"prompt_tokens must be >= 1 and decodes >= 0, got {prompt_tokens}, {decodes}")
    if new_prefiller_s is not None and not 0 <= new_prefiller_s < math.inf:
        raise ValueError(f"new_prefiller_s must be a finite number >= 0 or None, got {new_prefiller_s}")
    if decodes == 0:
        return None
    if rate is None:
        return "prefill rate not measured yet"
    if not 0 <= rate < math.inf:
        raise ValueError(f"rate must be a finite number >= 0 or None, got {rate}")
    if rate == 0:
        return "measured prefill rate 0 tok/s"
    pace = f"measured prefill rate {rate:.1f} tok/s"
    slower = _slower(prompt_tokens, rate, remote_s, pace)
    if slower is None and new_prefiller_s is not None:
        slower = _slower(prompt_tokens, rate, new_prefiller_s, pace)
        if slower is not None:
            slower += " (a new one, its load included)"
    return slower


def new_prefill_s(load_s: float, prompt_tokens: int, prefill_tokens_per_s: float) -> float:
    """What a prefill engine started now takes for a prompt: its predicted load (the planner's cost model) plus the
    prompt at one prefiller's velocity (a conservative bound: a live-loading target serves before its last block)."""
    if not (0 <= load_s < math.inf and prompt_tokens >= 0 and 0 < prefill_tokens_per_s < math.inf):
        raise ValueError(f"need a finite load_s >= 0, prompt_tokens >= 0 and a finite velocity > 0, got {load_s}, "
                         f"{prompt_tokens}, {prefill_tokens_per_s}")
    return load_s + prompt_tokens / prefill_tokens_per_s


def _slower(left: int, rate: float, remote_s: float | None, pace: str) -> str | None:
    """Why `left` prompt tokens at `rate` tok/s here finish later than the remote path's `remote_s` (None: they do
    not, or the remote path is not measured)."""
    if remote_s is None:
        return None
    local_s = left / rate
    if local_s > remote_s:
        return f"{pace}: {left} left would take {local_s:.3f} s here, {remote_s:.3f} s on the prefill engine"
    return None


def plan_conversions(c: ConversionInput) -> Conversions:
    plan = _plan(c)
    return replace(plan, step_budget_s=step_budget(c.tbt_slo_s), hand_back_s=hand_back(c.ttft_slo_s))


def _plan(c: ConversionInput) -> Conversions:
    chunk = chunk_budget(c.tbt_slo_s, c.prefill_tokens_per_s, c.decode_step_s)
    now = tuple(sorted(d.name for d in c.decoders if d.converted))
    if c.prefill_tokens_per_s is None:
        return Conversions((), (), chunk, len(now), "conversion: no prefill velocity configured or measured "
                                                    "(a prefiller's capacity: no saturated step yet); holding")
    v = c.prefill_tokens_per_s
    capacity = c.prefill_ready * v
    deficit = c.input_tokens_per_s - capacity
    head = (f"conversion: {c.input_tokens_per_s:.0f} input tok/s vs {c.prefill_ready} prefiller(s) x {v:.0f} = "
            f"{capacity:.0f} tok/s")
    share = CONVERTED_SHARE if c.converted_share is None else c.converted_share
    if deficit > 1e-9:
        want = min(len(c.decoders), math.ceil(deficit / (v * share) - 1e-9))
        if want <= len(now):
            return Conversions((), (), chunk, len(now), f"{head}; deficit {deficit:.0f} tok/s, {len(now)} converted "
                                                        "decoder(s) keep prefilling")
        step = "" if c.decode_step_s is None else f", decode step {c.decode_step_s * 1e3:.1f} ms"
        idle = sorted((d for d in c.decoders if not d.converted), key=lambda d: (d.in_flight, d.name))
        new = tuple(d.name for d in idle[:want - len(now)])
        return Conversions(new, (), chunk, len(now) + len(new),
                           f"{head}; deficit {deficit:.0f} tok/s, a converted decoder {share:.2f} of a prefiller"
                           f"{'' if c.converted_share is not None else ' (not measured)'} -> convert {', '.join(new)} "
                           f"(chunk budget {chunk} tokens{step})")
    if not now:
        return Conversions((), (), chunk, 0, f"{head}; no deficit")
    if c.prefill_queue:
        return Conversions((), (), chunk, len(now), f"{head}; {c.prefill_queue:.0f} prompt(s) still wait at "
                                                    "prefillers: converted decoders keep prefilling")
    return Conversions((), now, chunk, 0, f"{head}; prefill capacity covers the demand -> take back {', '.join(now)}")
