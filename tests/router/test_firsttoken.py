"""Routing on expected time to first token (kascade_router.firsttoken, balancer.least_ttft / pick_by_ttft):
the rate counts busy time only, the latency comes from unqueued requests, an unmeasured backend borrows the
others' medians, and the rule sends a request where it waits least, not where the claimed share is largest.
The router's choice of rule (`route`: ttft | share) and how disaggregated serving uses it (`pick_pd`); the
first tokens go with a backend that leaves. Through the real router and engines: test_router_ttft.py."""

from __future__ import annotations

import random

import pytest
from click.testing import CliRunner

from kascade_router.backends import Backend, Routes
from kascade_router.balancer import (
    expected_ttfts,
    least_ttft,
    pick,
    pick_by,
    pick_by_ttft,
    pick_pd,
    share_key,
)
from kascade_router.firsttoken import (
    MIN_SPAN_S,
    MIN_TOKENS,
    STALE_S,
    FirstTokens,
    Priors,
    Waiting,
    estimate,
    expected_ttft,
    priors,
)
from kascade_router.proxy import role_events
from kascade_router.settings import RouterSettings

NOW = 10.0  # when the tests' backends are asked (after every `_served`, within STALE_S of it)


def _served(ft: FirstTokens, n: int, gap_s: float, latency_s: float, start: float = 0.0) -> float:
    """n requests sent back to back at `start`, their first tokens `latency_s` later and then every `gap_s`."""
    aheads = [ft.sent(start) for _ in range(n)]
    t = start + latency_s
    for i, ahead in enumerate(aheads):
        ft.first(t, t - start, ahead)
        if i + 1 < n:
            t += gap_s
    return t


def test_the_rule() -> None:
    assert expected_ttft(0, 0.7, 4.0) == 0.7
    assert expected_ttft(8, 0.7, 4.0) == pytest.approx(2.7)
    with pytest.raises(ValueError, match="rate_per_s"):
        expected_ttft(1, 0.7, 0.0)
    with pytest.raises(ValueError, match="ahead"):
        expected_ttft(-1, 0.7, 1.0)


def test_rate_counts_busy_time_only_and_latency_comes_from_the_unqueued_request() -> None:
    ft = FirstTokens()
    assert ft.rate_per_s(0.0) is None and ft.latency_s is None
    end = _served(ft, 8, 0.25, 0.6)  # 4 first tokens per busy second
    assert ft.waiting == 0 and ft.rate_per_s(end) == pytest.approx(4.0)
    assert ft.latency_s == pytest.approx(0.6)  # the first one had nothing ahead
    # an idle stretch (shorter than STALE_S), then more: the rate must not be diluted by the idle time
    end = _served(ft, 8, 0.25, 0.6, start=end + 10.0)
    assert ft.rate_per_s(end + 10.0) == pytest.approx(4.0, rel=0.2)


def test_a_backend_left_idle_for_stale_s_is_measured_afresh() -> None:
    # Measured slow (2 first tokens/s, 3 s round trip), then left idle: after STALE_S its old numbers are
    # no evidence (it counts as unmeasured, priors from the others), and the next request starts a new
    # measurement instead of averaging with them.
    slow, fast = FirstTokens(), FirstTokens()
    end = _served(slow, 6, 0.5, 3.0)
    _served(fast, 8, 0.25, 0.6, start=end)
    assert slow.latency(end + 1) == pytest.approx(3.0) and slow.rate_per_s(end) == pytest.approx(2.0)
    later = end + STALE_S + 1
    assert slow.stale(later) and slow.latency(later) is None and slow.rate_per_s(later) is None
    p = priors([(slow, 1.0), (fast, 1.0)], end + 5)
    assert p.latency_s == pytest.approx(1.8)  # both fresh: the median of 3.0 and 0.6
    _served(fast, 8, 0.25, 0.6, start=later - 5)  # the fast one kept serving
    assert priors([(slow, 1.0), (fast, 1.0)], later).latency_s == pytest.approx(0.6)  # only the fresh one
    assert estimate(slow, 1.0, priors([(fast, 1.0)], later), later) == pytest.approx(0.6)  # ranked by priors
    ahead = slow.sent(later)  # sent again: the old measurement is forgotten, not averaged with the new one
    slow.first(later + 0.7, 0.7, ahead)
    assert slow.latency(later + 1) == pytest.approx(0.7)
    # waiting requests keep it fresh however long ago its last first token was (a stalled backend is not reset)
    stuck = FirstTokens()
    end = _served(stuck, 6, 0.25, 0.6)
    stuck.sent(end)
    assert not stuck.stale(end + 10 * STALE_S) and stuck.latency(end + 10 * STALE_S) == pytest.approx(0.6)


def test_one_batch_of_first_tokens_measures_no_rate_and_a_stall_lowers_it() -> None:
    """One step starts several prompts: their first tokens land together. Over those alone a rate would be
    hundreds per second; it waits for MIN_SPAN_S of busy time. While requests wait and no first token
    comes, the rate falls."""
    ft = FirstTokens()
    aheads = [ft.sent(0.0) for _ in range(8)]
    for i in range(4):
        ft.first(0.6 + 0.001 * i, 0.6, aheads[i])
    assert ft.rate_per_s(0.61) is None  # 4 first tokens in 3 ms: no rate yet
    assert ft.rate_per_s(0.6 + MIN_SPAN_S) == pytest.approx(3 / MIN_SPAN_S)  # still busy (4 wait): 3 per second
    assert ft.rate_per_s(0.6 + 2 * MIN_SPAN_S) == pytest.approx(3 / (2 * MIN_SPAN_S))  # a stall: half that


def test_fewer_first_tokens_than_the_minimum_measure_no_rate() -> None:
    ft = FirstTokens()
    _served(ft, MIN_TOKENS - 1, 0.6, 0.5)
    assert ft.rate_per_s(NOW) is None and ft.latency_s == pytest.approx(0.5)


def test_a_backend_slower_than_min_tokens_a_rate_span_is_rated_by_its_last_min_tokens() -> None:
    """Under load the slow prefill engine of test_router_ttft.py gave a first token every ~2 s of busy time: never
    MIN_TOKENS of them within RATE_SPAN_S, so it never had a rate (and took 19-27 of 48 prompts in 3 of 4 runs at
    load ~9, where 10 is the bound)."""
    ft = FirstTokens()
    end = _served(ft, 6, 2.0, 2.0)  # first tokens at 2, 4, ... 12 s of busy time
    assert ft.rate_per_s(end) == pytest.approx((MIN_TOKENS - 1) / ((MIN_TOKENS - 1) * 2.0))
    assert ft.rate_per_s(end + 3.0) == pytest.approx(ft.rate_per_s(end))  # idle: busy time stands still
    ft.sent(end + 3.0)
    assert ft.rate_per_s(end + 5.0) < ft.rate_per_s(end)  # busy and no first token: a stall lowers it


def test_with_nothing_ahead_the_latency_alone_ranks_and_needs_no_rate() -> None:
    """Requests one at a time: nothing of ours is ever ahead, so the expected TTFT is the latency. Needing a rate
    too, the rule fell back to the share rule (a coin toss) until the fast backend had MIN_SPAN_S of busy
    time: 20 first tokens of 50 ms."""
    fast, slow = Backend("fast", "fast:8000"), Backend("slow", "slow:8000")
    _served(fast.first_tokens, 2, 0.05, 0.05)
    _served(slow.first_tokens, 2, 1.8, 1.8)
    assert fast.first_tokens.rate_per_s(NOW) is None and slow.first_tokens.rate_per_s(NOW) is None
    assert expected_ttfts([fast, slow], now=NOW) == pytest.approx([0.05, 1.8])
    rng = random.Random(0)
    assert all(pick_by_ttft([fast, slow], rng, now=NOW) is fast for _ in range(20))
    slow.first_tokens.sent(NOW)  # one of ours waits there now: how long it is ahead needs a rate nobody has
    assert expected_ttfts([fast, slow], now=NOW) is None


def test_a_request_that_ends_without_a_first_token_stops_counting_as_ahead() -> None:
    ft = FirstTokens()
    ft.sent(0.0)
    ft.sent(0.0)
    ft.gone(0.5)
    assert ft.waiting == 1
    with pytest.raises(ValueError, match="ttft_s"):
        ft.first(1.0, -0.1, 0)


def test_an_unmeasured_backend_borrows_the_medians_per_unit_of_weight() -> None:
    a, b = FirstTokens(), FirstTokens()
    _served(a, 8, 0.25, 0.6)  # 4/s
    _served(b, 12, 0.125, 0.8)  # 8/s
    p = priors([(a, 1.0), (b, 1.0), (FirstTokens(), 4.0)], NOW)
    assert p.rate_per_weight == pytest.approx(6.0) and p.latency_s == pytest.approx(0.7)
    fresh = FirstTokens()
    for _ in range(12):
        fresh.sent(0.0)
    assert estimate(fresh, 2.0, p, NOW) == pytest.approx(0.7 + 12 / 12.0)  # weight 2: twice the median rate
    assert estimate(fresh, 2.0, Priors(None, None), NOW) is None  # nothing measured anywhere: no estimate


def _backend(pod: str, weight: float, waiting: int, gap_s: float | None, latency_s: float | None) -> Backend:
    b = Backend(pod, f"{pod}:8000", weight)
    if gap_s is not None and latency_s is not None:
        _served(b.first_tokens, 8, gap_s, latency_s)
    for _ in range(waiting):
        b.first_tokens.sent(NOW)
    b.in_flight = waiting
    return b


def test_the_least_expected_wait_wins_where_the_share_rule_picks_the_big_claim() -> None:
    """bench pipe4 after formation: sources with a few requests ahead at 4.4/s, a pipeline head claiming share 4
    that measured 3/s with 6 ahead. (in flight + 1) / weight sends the next request to the head (7/4 < 4);
    its expected TTFT is 0.8 + 6/3 = 2.8 s against a source's 0.6 + 3/4.4 = 1.3 s."""
    sources = [_backend(f"s{i}", 1.0, 3, 1 / 4.4, 0.6) for i in range(2)]
    head = _backend("head", 4.0, 6, 1 / 3, 0.8)
    pool = [*sources, head]
    assert min(pool, key=lambda b: share_key(b.in_flight, b.weight)) is head  # the old rule
    est = expected_ttfts(pool, now=NOW)
    assert est is not None and est[2] == pytest.approx(2.8) and est[0] == pytest.approx(0.6 + 3 / 4.4)
    assert least_ttft(pool, now=NOW) is sources[0]
    rng = random.Random(0)
    assert all(pick_by_ttft(pool, rng, now=NOW) is not head for _ in range(50))  # p2c: the head loses every pairing


def test_a_fresh_head_is_ranked_by_the_sources_priors_and_its_share() -> None:
    sources = [_backend(f"s{i}", 1.0, 8, 0.25, 0.6) for i in range(2)]  # 4/s, 8 ahead: 2.6 s
    head = _backend("head", 4.0, 0, None, None)  # just formed: nothing measured; prior 16/s, 0.6 s
    assert least_ttft([*sources, head], now=NOW) is head
    for _ in range(33):  # 33 ahead: 0.6 + 33/16 = 2.66 s > 2.6 s
        head.first_tokens.sent(NOW)
    assert least_ttft([*sources, head], now=NOW) is sources[0]


def test_with_nothing_measured_the_share_rule_stands() -> None:
    a, b = _backend("a", 1.0, 2, None, None), _backend("b", 4.0, 3, None, None)
    assert expected_ttfts([a, b], now=NOW) is None
    assert least_ttft([a, b]) is b  # (3 + 1) / 4 < (2 + 1) / 1
    assert least_ttft([a, b], weight=lambda x: 1.0) is a  # the caller's weights
    assert least_ttft([]) is None and pick_by_ttft([], random.Random(0)) is None


def test_share_key_is_the_one_share_rule() -> None:
    """pick, pick_by_ttft's fallback and least_ttft's fallback all rank by share_key: (in flight + 1) / weight."""
    assert share_key(3, 4.0) == 1.0 and share_key(0, 0.5) == 2.0
    a, b = _backend("a", 1.0, 2, None, None), _backend("b", 4.0, 3, None, None)  # keys 3 and 1
    rng = random.Random(0)
    for choose in (pick, pick_by_ttft, lambda pool, r: pick_by("share", pool, r), lambda pool, r: least_ttft(pool)):
        assert all(choose([a, b], rng) is b for _ in range(20)), choose
    b.in_flight = 12  # key 13/4 > 3
    assert all(pick_by("ttft", [a, b], rng) is a for _ in range(20))  # nothing measured: the share rule


def test_pick_by_names_the_rule() -> None:
    with pytest.raises(ValueError, match="route rule must be one of ttft, share, got 'fastest'"):
        pick_by("fastest", [Backend("a", "a:1")], random.Random(0))


def test_the_route_setting_is_checked_naming_it() -> None:
    assert RouterSettings().route == "ttft" and RouterSettings(route="share").route == "share"
    with pytest.raises(ValueError, match=r"router setting route \(--route, KASCADE_ROUTER_ROUTE\) must be one of "
                                         r"ttft, share, got 'fast'"):
        RouterSettings(route="fast")
    from kascade_cli.main import cli

    for args, env in ((["--route", "fast"], {}), ([], {"KASCADE_ROUTER_ROUTE": "fast"})):
        out = CliRunner().invoke(cli, ["router", "--backend", "m=h:1", *args], env=env)
        assert out.exit_code == 2 and "--route" in out.output and "'fast' is not one of 'ttft', 'share'" in out.output


def test_a_waiting_request_ends_once() -> None:
    ft = FirstTokens()
    w1, w2 = Waiting(ft, 1.0), Waiting(ft, 1.5)
    assert (w1.ahead, w2.ahead, ft.waiting) == (0, 1, 2)
    w1.first(1.75)
    w1.first(1.9)  # a second end changes nothing
    w1.gone(2.0)
    assert ft.waiting == 1 and ft.latency_s == 0.75
    w2.gone(3.0)
    w2.first(3.1)
    assert ft.waiting == 0 and ft.latency_s == 0.75 and ft.busy_s == pytest.approx(2.0)


def test_role_events_before_the_first_token() -> None:
    assert role_events("/v1/completions", {"n": 3}) == 0
    assert role_events("/v1/chat/completions", {}) == 1
    assert role_events("/v1/chat/completions", {"n": 3}) == 3
    assert role_events("/v1/chat/completions", {"n": True}) == role_events("/v1/chat/completions", {"n": "2"}) == 1


def _measured(b: Backend, latency_s: float, gap_s: float) -> Backend:
    _served(b.first_tokens, 8, gap_s, latency_s)
    return b


def test_colocated_backends_are_picked_by_the_rule() -> None:
    """One request at a time: nothing in flight, so share tosses a coin; ttft picks the lower latency."""
    fast, slow = _measured(Backend("fast", "f:1"), 0.05, 0.05), _measured(Backend("slow", "s:1"), 0.4, 0.4)
    rng = random.Random(3)
    by_ttft = {pick_pd([fast, slow], rng, rule="ttft", now=NOW)[0].pod for _ in range(40)}  # type: ignore[union-attr]
    by_share = [pick_pd([fast, slow], rng, rule="share", now=NOW)[0].pod for _ in range(40)]  # type: ignore[union-attr]
    assert by_ttft == {"fast"} and 10 <= by_share.count("slow") <= 30
    # every non-prefill replica gone: a prefill engine serves alone, by the rule too
    p1 = _measured(Backend("p1", "p:1", role="prefill", data="p:9"), 0.05, 0.05)
    p2 = _measured(Backend("p2", "p:2", role="prefill", data="p:8"), 0.4, 0.4)
    assert {pick_pd([p1, p2], rng, rule="ttft", now=NOW) for _ in range(20)} == {(p1, None)}


def test_disaggregated_decoders_by_share_prefill_engines_by_ttft_converted_decoders_by_their_share() -> None:
    rng = random.Random(5)
    # the decoders' first tokens (a converted decoder's own prefills) would pick d_slow; share picks the idle one
    d_busy = _measured(Backend("d_busy", "d:1", role="decode", in_flight=4), 0.05, 0.2)
    d_idle = _measured(Backend("d_idle", "d:2", role="decode"), 0.9, 0.9)
    slow_p = _measured(Backend("p_slow", "p:1", role="prefill", data="p:91"), 0.6, 0.6)
    fast_p = _measured(Backend("p_fast", "p:2", role="prefill", data="p:92"), 0.05, 0.2)
    fast_p.first_tokens.sent(NOW)  # one ahead at 5/s: 0.05 + 0.2 s, against p_slow's 0.6 s
    fast_p.in_flight = fast_p.prefilling = 1  # by prompts in prefill p_slow would win (0 + 1 < 1 + 1)
    picks = {pick_pd([d_busy, d_idle, slow_p, fast_p], rng, rule="ttft", now=NOW) for _ in range(30)}
    assert picks == {(d_idle, fast_p)}
    picks = {pick_pd([d_busy, d_idle, slow_p, fast_p], rng, rule="share", now=NOW) for _ in range(30)}
    assert picks == {(d_idle, slow_p)}
    # a converted decoder against a prefill engine: its measured prefill share ranks it (0.1 of a prefill
    # engine: its prompt costs 10), not its first tokens (which say 0.01 s: it only ever had nothing ahead)
    conv = _measured(Backend("conv", "c:1", role="decode", data="c:9", convertible=True, in_flight=9), 0.01, 0.5)
    conv.prefill_rate, fast_p.prefill_rate = 90.0, 900.0
    picks = {pick_pd([d_idle, conv, fast_p], rng, rule="ttft", now=NOW) for _ in range(30)}
    assert picks == {(d_idle, fast_p)}  # fast_p's cost 2 < conv's 10


def test_a_backend_that_leaves_takes_its_first_tokens_with_it() -> None:
    r = Routes()
    r.set_service("ns", "svc", "m")
    pod = {"metadata": {"namespace": "ns", "name": "a", "labels": {"kascade.io/model-service": "svc"},
                        "annotations": {"kascade.io/endpoint": "h:1", "kascade.io/loaded": "true"}},
           "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    r.set_pod(pod)
    (b,) = r.serving(("ns", "svc"))
    _served(b.first_tokens, 8, 0.25, 0.6)
    r.set_pod({**pod, "metadata": {**pod["metadata"], "annotations": {**pod["metadata"]["annotations"], "x": "y"}}})
    assert r.serving(("ns", "svc"))[0].first_tokens is b.first_tokens  # a pod update keeps them
    r.set_pod({**pod, "status": {"conditions": [{"type": "Ready", "status": "False"}]}})  # not Ready: gone
    assert r.serving(("ns", "svc")) == []
    r.set_pod(pod)  # back: measured afresh
    (b2,) = r.serving(("ns", "svc"))
    assert b2 is not b and b2.first_tokens.latency_s is None and b2.first_tokens.busy_s == 0
    r.remove_pod("ns", "a")
    assert r.backends[("ns", "svc")] == {}
