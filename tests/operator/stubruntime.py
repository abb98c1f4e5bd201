"""The operator's Runtime for tests on loopback: the fake kube layer (fakekube.py) for the API server and
engine stubs (enginestub.py) answering the control API over real HTTP.

Data flow: a FakeKube and the stubs the test made -> `stub_runtime` -> a Runtime whose EngineClient carries
the stubs' token -> the test drives rounds, plans and drivers on it -> on exit the client's connections and
every stub's server are closed, in that order.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable

from enginestub import EngineStub
from fakekube import FakeKube

from kascade_operator.engine_client import EngineClient
from kascade_operator.metrics import Scraper
from kascade_operator.operator_metrics import OperatorMetrics
from kascade_operator.runtime import Runtime
from kascade_operator.settings import OperatorSettings


class Stopped:
    """A kopf daemon's `stopped` flag that is never set: the driver runs until its plan ends."""

    def __bool__(self) -> bool:
        return False


@contextlib.asynccontextmanager
async def stub_runtime(kube: FakeKube, stubs: Iterable[EngineStub], token: str,
                       clock: Callable[[], float] = time.monotonic) -> AsyncIterator[Runtime]:
    """A Runtime over `kube` that reaches `stubs` with `token`, its scraper on `clock` (the stubs' FakeClock makes
    measured rates exact); closes the client, then the stubs."""
    rt = Runtime(OperatorSettings(engine_token=token), kube, EngineClient(token), Scraper(clock=clock), None,
                 OperatorMetrics())
    try:
        yield rt
    finally:
        await rt.engines.aclose()
        for s in stubs:
            s.close()
