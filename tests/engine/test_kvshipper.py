"""The prefill engine's step hook (pd/prefill_server.py `KVShipper`) while the event loop drops a request's sink
mid-step: its decode engine went away (PrefillServer._one's `finally`), and the step must go on."""

from __future__ import annotations

from kascade_engine.batch.engine import Engine
from kascade_engine.batch.sampling import SamplingParams
from kascade_engine.pd.prefill_server import KVPiece, KVShipper


def test_a_sink_dropped_during_the_step_fails_neither_the_step_nor_the_other_requests(tiny_engine: Engine) -> None:
    eng = tiny_engine
    shipper = KVShipper(None)
    eng.coop = shipper
    params = SamplingParams(max_tokens=1)
    remote = eng.submit([11, 42, 7, 300, 5], params)
    kept = eng.submit([1, 2, 3], params)
    local = eng.submit([9, 8, 7], params)
    got: dict[str, list[KVPiece]] = {remote: [], kept: []}

    def gone(piece: KVPiece) -> None:  # as the loop's `finally` runs while the step ships layer 0
        got[remote].append(piece)
        shipper.sinks.pop(remote, None)

    shipper.sinks[remote] = gone
    shipper.sinks[kept] = got[kept].append
    events = eng.step()  # a KeyError here failed every request on the engine (Serving._run)
    layers = eng.model.shape.layers
    assert [p.layer for p in got[kept]] == list(range(layers)) and all(p.n == 3 for p in got[kept])
    # the dropped one's KV still went to its old sink (nobody reads it) until the step ended
    assert [p.layer for p in got[remote]] == list(range(layers))
    assert remote not in shipper.sinks
    assert {e.request for e in events if e.token >= 0} == {remote, kept, local}
