"""Pick a backend for one request: power of two choices, on expected time to first token or on outstanding
requests per unit of weight.

Two distinct usable backends are sampled at random and the better one wins: near-best without scanning or
herding (every router replica alone sees only its own requests, and random sampling keeps several replicas
from piling onto one engine). Two rules rank them (`ROUTE_RULES`, the router's `route` setting):
- "share": the lower (in flight + 1) / weight (`share_key`). A live (loading) replica weighs the share of
  layers its engine reports running, so it takes a smaller share of requests until it holds every layer.
- "ttft" (default): the lower expected TTFT (firsttoken.py: measured first-token rate and latency of this
  router's own requests there, the pool's medians for a backend not measured yet), "share" while either of
  the two has no estimate (nothing measured anywhere yet).

Disaggregated serving (`pick_pd`): the decode engine is picked by "share" (its in-flight count is the
streams it decodes, which set its step time; it does not prefill them, so its first tokens measure nothing of
its own); the prefill engine by the rule among prefill engines, and a converted decoder against a prefill
engine always by its measured prefill share (`_prefill_cost`). Why: docs/router.md, "Balancing".
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Collection, Sequence

from kascade_planner.conversion import converted_share
from kascade_router.backends import Backend
from kascade_router.firsttoken import Priors, estimate, priors

ROUTE_RULES = ("ttft", "share")  # the router's `route` setting (kascade_router.settings)

# a converted decoder takes a prompt only while its step budget gives a chunk at least this many tokens now
# (its reported prefill room): beside a big batch the budget gives a prompt 0 tokens and it waited there for
# seconds (bench/pd.py: convertible TTFT p99 4.7-11.3 s against 2.2-5.1 s disaggregated)
MIN_PREFILL_ROOM = 8


def share_key(in_flight: int, weight: float) -> float:
    """The "share" rule's key (lower wins): this router's requests there with the next one added, per unit of
    weight (the capacity the backend claims: 1 for a complete copy, a live replica's reported share)."""
    return (in_flight + 1) / weight


def pick(backends: Sequence[Backend], rng: random.Random, exclude: Collection[str] = ()) -> Backend | None:
    """Power of two choices on `share_key`."""
    pool = [b for b in backends if b.pod not in exclude] if exclude else list(backends)
    if not pool:
        return None
    if len(pool) == 1:
        return pool[0]
    a, b = rng.sample(pool, 2)
    return a if share_key(a.in_flight, a.weight) <= share_key(b.in_flight, b.weight) else b


def pick_by(rule: str, backends: Sequence[Backend], rng: random.Random, exclude: Collection[str] = (),
            now: float | None = None) -> Backend | None:
    """Power of two choices by `rule` (one of ROUTE_RULES); `now` as in `pick_by_ttft`."""
    if rule == "ttft":
        return pick_by_ttft(backends, rng, exclude, now)
    if rule == "share":
        return pick(backends, rng, exclude)
    raise ValueError(f"route rule must be one of {', '.join(ROUTE_RULES)}, got {rule!r}")


def expected_ttfts(backends: Sequence[Backend], weight: Callable[[Backend], float] = lambda b: b.weight,
                   now: float | None = None) -> list[float] | None:
    """Each backend's expected TTFT for one more request (firsttoken.py: measured rate and latency, the others'
    medians where it has none yet), in order; None when any has no estimate (nothing measured anywhere).
    `now`: the clock the first tokens were timed on (time.monotonic by default)."""
    t = time.monotonic() if now is None else now
    prior = priors(((b.first_tokens, weight(b)) for b in backends), t)
    out = [estimate(b.first_tokens, weight(b), prior, t) for b in backends]
    return None if any(e is None for e in out) else [e for e in out if e is not None]


def pick_by_ttft(backends: Sequence[Backend], rng: random.Random, exclude: Collection[str] = (),
                 now: float | None = None) -> Backend | None:
    """Power of two choices on expected TTFT; `share_key` while either of the two has no estimate. Each is
    estimated from its own measurements; only when one lacks them are the whole pool's medians (`priors`)
    computed, not on every pick (~4 us a backend: 250 us a request with 64 backends)."""
    pool = [b for b in backends if b.pod not in exclude] if exclude else list(backends)
    if len(pool) <= 1:
        return pool[0] if pool else None
    a, b = rng.sample(pool, 2)
    won = _by_ttft(a, b, pool, now)
    if won is None:
        return a if share_key(a.in_flight, a.weight) <= share_key(b.in_flight, b.weight) else b
    return won


def _by_ttft(a: Backend, b: Backend, pool: Sequence[Backend], now: float | None) -> Backend | None:
    """The one of `a`, `b` with the lower expected TTFT (a on a tie); None while either has no estimate. Priors
    (for one not measured yet) are the medians of `pool`."""
    t = time.monotonic() if now is None else now
    none = Priors(None, None)
    ea, eb = estimate(a.first_tokens, a.weight, none, t), estimate(b.first_tokens, b.weight, none, t)
    if ea is None or eb is None:
        prior = priors(((x.first_tokens, x.weight) for x in pool), t)
        ea, eb = estimate(a.first_tokens, a.weight, prior, t), estimate(b.first_tokens, b.weight, prior, t)
    if ea is None or eb is None:
        return None
    return a if ea <= eb else b


def least_ttft(backends: Sequence[Backend], weight: Callable[[Backend], float] = lambda b: b.weight,
               now: float | None = None) -> Backend | None:
    """The backend with the least expected TTFT, scanning all (a caller that sees every backend: bench/livelab.py);
    the least (in flight + 1) / weight while any has no estimate. Ties: the first."""
    if not backends:
        return None
    est = expected_ttfts(backends, weight, now)
    keys = est if est is not None else [share_key(b.in_flight, weight(b)) for b in backends]
    return backends[min(range(len(backends)), key=keys.__getitem__)]


def _prefill_load(b: Backend, share: float) -> float:
    """A prefill candidate's load, in prefill engines' worth of work: a prefill engine's requests (the
    router holds each one only until its first token); a converted decoder's prompts in prefill
    (`Backend.prefilling`), not its `in_flight`, which also holds every request it decodes, including the
    ones a prefill engine prefills for it: by `in_flight` it would never be the less loaded candidate.
    A converted decoder prefills at `share` of a prefill engine's speed (`_share`), so each of its prompts
    counts 1 / share: ranked by prompts alone it took as many as a prefill engine with the same count, and
    they waited behind its slower chunks (burst TTFT 0.00 in bench run D)."""
    return float(b.in_flight) if b.role == "prefill" else b.prefilling / share


def _share(b: Backend, pool: Sequence[Backend]) -> float:
    """How much of a prefill engine `b` is: 1 for a prefill engine; for a converted decoder its reported prefill
    rate over the prefill engines' mean (`converted_share`: the constant until both are measured). With the
    constant 0.5 the decoder took burst prompts it prefilled at 7-45 % of the prefill engine's pace, held each
    for its hand-back bound and handed it back with its partial prefill dropped (bench/pd.py)."""
    if b.role == "prefill":
        return 1.0
    rates = [p.prefill_rate for p in pool if p.role == "prefill" and p.prefill_rate]
    return converted_share(b.prefill_rate, sum(rates) / len(rates) if rates else None)


def _pick_prefill(pool: Sequence[Backend], rng: random.Random, rule: str = "ttft",
                  now: float | None = None) -> Backend | None:
    """Power of two choices. Two prefill engines under "ttft": the lower expected TTFT (their first tokens: the
    router holds each prompt on its prefill engine until its first token, so they measure that engine's queue
    and pace; priors from the prefill engines only), `_prefill_cost` while any has no estimate. Otherwise, and
    always when a converted decoder is one of the two: `_prefill_cost`, whose share is the decoder's measured
    prefill rate over the prefill engines' (its own first tokens cannot rank it: it takes one prompt at a time,
    so nothing is ever ahead there, and a latency borrowed from prefill engines ignores its slower pace).
    On a cost tie a prefill engine wins over a converted decoder. The converted decoder is the overflow, not a
    peer: a prompt it takes may wait up to its hand-back bound before it goes to a prefill engine after all,
    and one sent there at once does not (bench/pd.py: the burst's first
    prompt went to the decoder on a 2-to-2 tie, was handed back 0.27 s later, and every later burst prompt on
    the saturated prefill engine was that late)."""
    if len(pool) <= 1:
        return pool[0] if pool else None
    a, b = rng.sample(list(pool), 2)
    if rule == "ttft" and a.role == "prefill" and b.role == "prefill":
        won = _by_ttft(a, b, [p for p in pool if p.role == "prefill"], now)
        if won is not None:
            return won
    return min(a, b, key=lambda x: (_prefill_cost(x, pool), x.role != "prefill"))


def _prefill_cost(b: Backend, pool: Sequence[Backend]) -> float:
    """Its load with the next prompt added, per unit of weight (`pool`: the candidates, for a decoder's share)."""
    share = _share(b, pool)
    return (_prefill_load(b, share) + (1.0 if b.role == "prefill" else 1 / share)) / b.weight


def pick_pd(backends: Sequence[Backend], rng: random.Random, exclude: Collection[str] = (),
            rule: str = "ttft", now: float | None = None) -> tuple[Backend | None, Backend | None]:
    """(the engine the request goes to, the prefill engine for it or None). A service without decode engines
    and prefill candidates (colocated) picks by `rule` (`pick_by`), its engines prefilling their own requests.
    Disaggregated: the decode instance is chosen first (the response streams from it) by "share" whatever the
    rule (its in-flight count is the streams it decodes, which set its step time; the first tokens of the
    requests it decodes are the prefill engines' measure, not its own), then a prefill engine with a data
    address (`_pick_prefill`, by `rule` among prefill engines). When every non-prefill replica is gone, a prefill
    engine serves the whole request alone (it can: every engine runs both phases), picked by `rule`.
    Convertible decoders (annotated by the operator under a prefill burst) join the prefill candidates,
    itself included when the chosen decoder is one: the candidate with fewer prompts in prefill per unit of its
    measured share takes it (`_prefill_cost`), so converted decoders absorb prefill only while the prefill
    engines are busier (picked itself: it prefills locally), and a converted decoder takes a prompt only while
    it prefills none (when every candidate is a busy converted decoder, the least busy still takes it). `now`:
    the clock the first tokens were timed on (time.monotonic by default)."""
    rest = [b for b in backends if b.role != "prefill"]
    prefill = [b for b in backends if b.data and (b.role == "prefill" or b.convertible)]
    disaggregated = bool(prefill) and any(b.role == "decode" for b in rest)
    d = pick(rest, rng, exclude) if disaggregated else pick_by(rule, rest, rng, exclude, now)
    if d is None:
        return pick_by(rule, backends, rng, exclude, now), None
    if d.role != "decode" or not prefill or (d.convertible and len(prefill) == 1):
        return d, None
    # a converted decoder prefills one prompt at a time: its chunk budget gives it a few tokens a step, so a
    # second prompt would only queue behind the first (bench run 2: 10 prompts queued on one converted
    # decoder, TTFT p99 17.8 s); while it prefills one, prefill engines take the rest
    free = [b for b in prefill if b.role == "prefill" or (
        b.prefilling == 0 and (b.prefill_room is None or b.prefill_room >= MIN_PREFILL_ROOM))]
    if free:
        prefill = free
    p = _pick_prefill(prefill, rng, rule, now)
    return (d, None) if p is d else (d, p)


def fallback_prefill(backends: Sequence[Backend], d: Backend, pre: Backend | None) -> Backend | None:
    """Where a converted decoder hands a prompt it prefills if its step budget leaves it no room after all (the
    engine's hand-back, PREFILL_FALLBACK_HEADER): the least loaded prefill engine with a data address. Two cases:
    - `d` prefills it itself (`pick_pd` gave it no prefill engine, `pre` None);
    - `pre` is a converted decoder prefilling it for `d`: `d` passes the address on in its prefill op, and a
      prompt `pre` declines or hands back is prefilled there instead of on `d` (kascade_engine.pd.remote_prefill).
    Its room report (`Backend.prefill_room`) is as old as its last answer, and a batch can grow after the prompt
    arrived. None when there is nothing to hand to, or a prefill engine prefills it anyway."""
    who = d if pre is None else pre
    if who.role != "decode" or not who.convertible:
        return None
    pool = [b for b in backends if b.role == "prefill" and b.data and b is not d and b is not pre]
    return min(pool, key=lambda p: _prefill_cost(p, pool), default=None)
