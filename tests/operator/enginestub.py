"""A stand-in engine for operator tests on loopback: a real HTTP server speaking the engine control
API (bearer token, /kascade/v1/...) and Prometheus text on /metrics, recording every control call.

It is an edge input for the operator (the component under test): calls travel over real HTTP, and the
test controls when "loading" finishes and how much load the metrics report.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl

from kascade_planner.loadwatch import TICK_S, LoadWatch, WindowRate


class FakeClock:
    """A monotonic clock a test advances: the seconds a rate is measured over, without sleeping them."""

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


IDLE_TICK_S = 0.25  # a held load watch's sampling on a FakeClock while the load is unchanged (EngineStub.hold)


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went while its call was answered (an operator stopped while holding a load watch) is
        no error of the stand-in: not printed. Anything else is, as the standard server does."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class EngineStub:
    def __init__(self, instance: str, model: str, token: str, auto_ready: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`clock`: what its token counter counts on (a test's FakeClock makes the rates a scraper on the same
        clock measures exact, whatever the machine's load)."""
        self.clock = clock
        self.instance, self.model, self.token = instance, model, token
        self.auto_ready = auto_ready  # bind/load-plan -> ready at once
        self.phase, self.model_service, self.role = "empty", None, None
        self.calls: list[tuple[str, dict[str, Any], float]] = []  # (verb, body, monotonic time)
        self.refused = 0  # binds answered 409 (wrong model, or bound to another service)
        self.switched = 0  # binds that changed the engine's model (bind with modelPath while empty or released)
        # as the engine's --host-cache-gib: a release keeps a host copy of this many bytes unless told
        # keepHostCopy false (0: no budget, nothing kept)
        self.host_cache_bytes, self.host_copy_bytes = 0, 0
        self.fail: dict[str, int] = {}  # verb -> HTTP status it is answered with (e.g. a load-plan refused)
        self.delay: dict[str, float] = {}  # verb -> seconds its answer takes (e.g. a slow source's load-plan)
        # GET manifest: this answer (recorded in `calls` as ("manifest", {"parts": g}, t)); None: 404, an engine
        # offering none (the operator then plans on spec.model.layers)
        self.manifest: dict[str, Any] | None = None
        self._rate, self._total, self._t = 0.0, 0.0, clock()
        self._lock = threading.Lock()
        self._prompt_rate = WindowRate()  # sampled while a load watch is held, as the engine's
        self._rate_since = -1e18  # (stand-in clock) when the load was last set
        self._load_set = threading.Condition(self._lock)  # notified when it is
        self.watches = 0  # load watches answered
        stub = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, like the real engine (uvicorn): no connect per scrape
            # TCP_NODELAY, like uvicorn: headers and body go out in two writes, and with Nagle the body waited
            # for the client's delayed ACK (40 ms on every scrape, bind and status call of a kept-alive connection)
            disable_nagle_algorithm = True

            def log_message(self, *a: Any) -> None:
                pass

            def _send(self, code: int, doc: Any, ctype: str = "application/json") -> None:
                data = doc.encode() if isinstance(doc, str) else json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                path, _, query = self.path.partition("?")
                if path == "/metrics":
                    try:  # the engine's load watch (kascade_planner.loadwatch), as the real engine's /metrics
                        watch = LoadWatch.from_query(dict(parse_qsl(query)))
                    except ValueError as e:
                        self._send(400, f"load watch: {e}\n", "text/plain")
                        return
                    if watch is not None:
                        stub.hold(watch)
                    self._send(200, stub.metrics_text(), "text/plain; version=0.0.4")
                elif self._auth():
                    if path.endswith("/status"):
                        with stub._lock:
                            stub.calls.append(("status", {}, time.monotonic()))
                    if self.path.endswith("/status") and "status" in stub.fail:  # an engine that does not answer
                        self._send(stub.fail["status"], {"error": {"message": "status refused (stub)"}})
                    elif self.path.endswith("/status"):
                        self._send(200, stub.status())
                    elif path.endswith("/manifest"):
                        with stub._lock:
                            stub.calls.append(("manifest", {"parts": int(dict(parse_qsl(query)).get("parts", 1))},
                                               time.monotonic()))
                        if stub.manifest is None:
                            self._send(404, {"error": {"message": "not found"}})
                        else:
                            self._send(200, stub.manifest)
                    else:
                        self._send(404, {"error": {"message": "not found"}})

            def do_POST(self) -> None:
                if not self._auth():
                    return
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                verb = self.path.rsplit("/", 1)[-1]
                with stub._lock:
                    stub.calls.append((verb, body, time.monotonic()))
                if verb in stub.delay:  # each request has its own thread: the others are answered meanwhile
                    time.sleep(stub.delay[verb])
                with stub._lock:
                    if verb in stub.fail:
                        self._send(stub.fail[verb], {"error": {"message": f"{verb} refused (stub)"}})
                        return
                    if verb == "bind" and body.get("model") != stub.model and body.get("modelPath") \
                            and stub.model_service is None and stub.phase in ("empty", "released"):
                        # as the real engine (switch_model): one holding no weights changes model, its copy goes
                        stub.model, stub.switched, stub.host_copy_bytes = body["model"], stub.switched + 1, 0
                    if verb == "bind" and body.get("model") != stub.model:  # as the real engine: 409
                        stub.refused += 1
                        self._send(409, {"error": {"message": f"cannot bind model '{body.get('model')}': this "
                                                              f"engine holds '{stub.model}'"}})
                        return
                    if verb == "bind" and stub.model_service not in (None, body["modelService"]):
                        stub.refused += 1
                        self._send(409, {"error": {"message": f"engine is bound to '{stub.model_service}'"}})
                        return
                    if verb == "bind":
                        stub.model_service, stub.role = body["modelService"], body["role"]
                        stub.phase = "serving" if stub.auto_ready else "loading"
                    elif verb == "load-plan":
                        stub.phase = "serving" if stub.auto_ready else "loading"
                    elif verb == "drain":
                        stub.phase = "draining"
                    elif verb == "host-copy":  # as the real engine: a serving one keeps its copy within the budget
                        keep = body.get("keep", True) is not False
                        ok = keep and stub.phase == "serving" and stub.host_cache_bytes > 0
                        stub.host_copy_bytes = stub.host_cache_bytes if ok else 0
                        self._send(200, {"hostCopyBytes": stub.host_copy_bytes,
                                         **({} if ok or not keep else {"reason": "no --host-cache-gib budget"})})
                        return
                    elif verb == "release":
                        keep = body.get("keepHostCopy") is not False and stub.phase in ("serving", "draining")
                        stub.host_copy_bytes = stub.host_cache_bytes if keep else 0
                        stub.phase, stub.model_service = "empty", None
                self._send(200, stub.status())

            def _auth(self) -> bool:
                if self.headers.get("Authorization") != f"Bearer {stub.token}":
                    self._send(403, {"error": {"message": "bearer token rejected"}})
                    return False
                return True

        self.server = _Server(("127.0.0.1", 0), H)
        self.endpoint = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def status(self) -> dict[str, Any]:
        ready = self.phase == "serving"
        return {"instance": self.instance, "model": self.model, "role": self.role, "modelService": self.model_service,
                "phase": self.phase, "blocks": {"embed": ready, "head": ready}, "bytesReceived": 0, "ready": ready,
                "hostCopyBytes": self.host_copy_bytes}

    def _advance(self) -> float:
        now = self.clock()
        self._total += self._rate * (now - self._t)
        self._t = now
        return self._total

    @property
    def tokens_per_s(self) -> float:
        return self._rate

    @tokens_per_s.setter
    def tokens_per_s(self, rate: float) -> None:
        """Load from now on (the counter keeps what it counted so far)."""
        with self._lock:
            self._advance()
            self._rate, self._rate_since = rate, self.clock()
            self._load_set.notify_all()

    def hold(self, watch: LoadWatch) -> None:
        """As the engine's /metrics with a watch: until prompt tokens/s over its window leaves the band, or the wait."""
        end = time.monotonic() + watch.wait_s
        while True:
            with self._lock:
                self._prompt_rate.add(self.clock(), self._advance())
                if watch.left(self._prompt_rate.rate(watch.window_s)) or time.monotonic() >= end:
                    break
                # the load has been the same for a whole window: the windowed rate stays as it is until the load
                # is set again (hundreds of stand-ins share a process and its interpreter lock: no 20 ms ticks
                # while nothing can change; at most IDLE_TICK_S, for a FakeClock a test advances)
                if self.clock() - self._rate_since >= watch.window_s:
                    left = max(0.0, end - time.monotonic())
                    # on the real clock only a new load can change the rate: sleep until one is set (1,000 held
                    # watches ticking 4 times a second kept two stand-in processes' interpreter locks busy)
                    self._load_set.wait(left if self.clock is time.monotonic else min(IDLE_TICK_S, left))
                    continue
            time.sleep(TICK_S)
        with self._lock:
            self.watches += 1

    def metrics_text(self) -> str:
        with self._lock:
            total = self._advance()
        return ("# TYPE kascade_prompt_tokens counter\n"
                f"kascade_prompt_tokens_total {total}\n"
                "# TYPE kascade_num_requests_waiting gauge\nkascade_num_requests_waiting 0\n")

    def count(self, verb: str) -> int:
        with self._lock:
            return sum(1 for v, _, _ in self.calls if v == verb)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
