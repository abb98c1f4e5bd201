"""A step's hook (batch/engine.py `StepHooks`) is read once per step: the hook that prepared the step runs its
forward and hands over the tokens that landed in it, whoever replaces `Engine.coop` meanwhile — the event loop
installing a new pair (peering.py) or the hook stepping down inside its own forward (live/pairclient.py: a plain
engine again). Reading `coop` again at the step's end asked the new hook for the old one's tokens: lost."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kascade_engine.batch.engine import Engine, Event, StepHooks
from kascade_engine.batch.sampling import SamplingParams
from kascade_engine.batch.scheduler import Work
from kascade_engine.pd.prefill_server import KVPiece, KVShipper


class Landing:
    """A hook that runs the engine's own forward and, inside it, lands a token of a request it ran elsewhere
    (as PairClient._land does) and then calls `inside` (what happens to `coop` meanwhile)."""

    def __init__(self, name: str, inside: Callable[[Engine], None] = lambda eng: None) -> None:
        self.name, self.inside = name, inside
        self.busy = False  # rows out on a peer: a KV shipper over it runs its forward (not its own)
        self.calls: list[str] = []
        self.events: list[Event] = []

    def pending(self) -> bool:
        return self.busy

    def prepare(self, engine: Engine) -> None:
        self.calls.append("prepare")

    def forward(self, engine: Engine, work: list[Work]) -> Sequence[int | None]:
        self.calls.append("forward")
        toks = engine._forward(work)
        self.events.append(Event(f"far-{self.name}", 7, True, "stop"))
        self.inside(engine)
        return toks

    def abort(self, rid: str) -> None:
        self.calls.append("abort")

    def take_events(self) -> list[Event]:
        self.calls.append("take_events")
        out, self.events = self.events, []
        return out


def _hook(eng: Engine) -> StepHooks | None:  # (typed as the engine's, whatever the test installed)
    return eng.coop


def test_a_hook_replaced_mid_step_still_ends_the_step_it_began(tiny_engine: Engine) -> None:
    eng = tiny_engine
    new = Landing("new")
    old = Landing("old", inside=lambda e: setattr(e, "coop", new))  # the loop's set_cooperate, mid-forward
    eng.coop = old
    rid = eng.submit([1, 2, 3], SamplingParams(max_tokens=4))
    events = eng.step()
    assert old.calls == ["prepare", "forward", "take_events"] and new.calls == []
    assert {(e.request, e.token) for e in events if e.request == "far-old"} == {("far-old", 7)}
    assert [e.request for e in events if e.request == rid] == [rid]  # the engine's own token as well
    eng.step()  # the next step is the new hook's, from its start
    assert new.calls == ["prepare", "forward", "take_events"] and old.calls.count("forward") == 1


def test_a_hook_stepping_down_inside_its_forward_hands_over_what_landed_there(tiny_engine: Engine) -> None:
    eng = tiny_engine
    pair = Landing("pair")

    def plain(e: Engine) -> None:  # PairClient: a plain engine again
        e.step_down(pair, None)

    pair.inside = plain
    eng.coop = pair
    rid = eng.submit([4, 5, 6], SamplingParams(max_tokens=2))
    events = eng.step()
    assert [e.request for e in events].count("far-pair") == 1  # taken from the hook that ran the step
    assert pair.events == [] and _hook(eng) is None
    events += eng.step()  # a plain step now: the request ends by length
    assert [e.finished for e in events if e.request == rid] == [False, True]


def _shipping(eng: Engine, shipper: KVShipper) -> tuple[str, list[KVPiece]]:
    """A remote prompt (a decode engine's) in the batch, its KV pieces collected."""
    got: list[KVPiece] = []
    rid = eng.submit([11, 42, 7, 300, 5], SamplingParams(max_tokens=1))
    shipper.sinks[rid] = got.append
    return rid, got


def test_a_pair_stepping_down_under_the_kv_shipper_leaves_the_shipper_and_its_sinks(tiny_engine: Engine) -> None:
    eng = tiny_engine
    host = Landing("host")
    pair = Landing("pair")
    pair.busy = True

    def done(e: Engine) -> None:
        pair.busy = False
        e.step_down(pair, host)

    pair.inside = done
    eng.coop = pair
    shipper = eng.wrap_hook(KVShipper, KVShipper)  # a decode engine's prefill op while the pair runs
    assert _hook(eng) is shipper and shipper.inner is pair and eng.wrap_hook(KVShipper, KVShipper) is shipper
    rid, got = _shipping(eng, shipper)
    events = eng.step()
    # the pair's step ended in its own forward: the shipper runs the host's rows now, and still ships
    assert _hook(eng) is shipper and shipper.inner is host and rid in shipper.sinks
    assert [e.request for e in events].count("far-pair") == 1
    assert [p.layer for p in got] == list(range(eng.model.shape.layers))
    _, more = _shipping(eng, shipper)
    eng.step()
    # the next step's prompt is shipped too, layer by layer by the shipper itself (no rows out on a peer)
    assert host.calls == ["take_events", "prepare", "take_events"]
    assert [(p.layer, p.n) for p in more] == [(layer, 5) for layer in range(eng.model.shape.layers)]


def test_the_loop_replacing_the_pair_wins_over_the_pair_stepping_down_and_keeps_the_shipper(
        tiny_engine: Engine) -> None:
    eng = tiny_engine
    host, new = Landing("host"), Landing("new")
    pair = Landing("pair")
    pair.busy = True
    eng.coop = pair
    shipper = eng.wrap_hook(KVShipper, KVShipper)

    def replaced_then_done(e: Engine) -> None:  # peering.set_cooperate, then the old pair's step-down
        pair.busy = False
        e.set_hook(new)
        assert e.step_down(pair, host) is False

    pair.inside = replaced_then_done
    _, got = _shipping(eng, shipper)
    events = eng.step()
    assert _hook(eng) is shipper and shipper.inner is new and len(got) == eng.model.shape.layers
    assert [e.request for e in events].count("far-pair") == 1 and host.calls == []
    eng.set_hook(None)  # cooperation off with no hosted rows: the shipper runs the engine's own forward
    assert _hook(eng) is shipper and shipper.inner is None
