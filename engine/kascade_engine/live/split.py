"""Live cooperative execution, per request: a loading engine B runs the resident prefix of layers for a
request and ships the activations to the full engine A over the data-plane `Transport`; A runs the rest,
samples, and returns the token. The serving engine no longer uses this per-request path: a live engine
runs the split per step inside both batches over one pair connection (cooperation.py; its session
starts on the same activation port, after the same hello, with {"op": "pair"}). The per-request
protocol below stays for tools and tests that drive a single sequence.

Wire format (explicit, no pickle), one transport frame per step:
  B -> A  header {"op": "act", "req", "start" (position of the first token), "layer" (k: first layer
          A runs), "shape" [T, H], "dtype", "params" {temperature, top_p, seed}} + raw tensor bytes
          (row-major, little endian);  {"op": "end", "req"} frees A's state;  {"op": "poll"} asks
          whether A is idle (ZigZag: A takes a request over only when idle).
  A -> B  {"op": "token", "req", "token"}, {"op": "load", "idle"}  or  {"op": "error", "req", "message"}.
A Finisher built with a token (every engine's: the control API token from the same Secret) first runs
  `peerauth`'s mutual challenge–response (the token never crosses the wire); anything else closes the connection, so
  only
engines of the same installation can make A run layers.
Where the KV cache lives: layers 0..k-1 on B (`SplitClient`), layers k..L-1 on A (`Finisher`), keyed by
request id. Decode continues with the same split: each new token is embedded on B, runs B's layers,
and its activation row goes to A, so neither cache ever moves. A request keeps its split k until it
finishes; only new requests see a longer prefix as more blocks arrive.
Split point: best-effort fixes k = the resident prefix at admission; ZigZag (`zigzag=True`) keeps
advancing the prompt through layers as they land and hands over only when A reports idle (or B holds
every layer), as in the ILP-free ZigZag policy of kascade_planner.zigzag.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kascade_engine.batch.kvcache import SequenceKV
from kascade_engine.batch.model import LlamaModel
from kascade_engine.batch.sampling import SamplingParams, sample
from kascade_engine.live.activation import decode_activation, encode_activation
from kascade_engine.net import peerauth
from kascade_engine.net.transport import Connection, Header, TransportError

log = logging.getLogger(__name__)
MAX_ACT_TOKENS = 8192  # rows of one activation frame (a prompt's tokens); bounds what a frame may announce


@dataclass
class _Remote:
    kv: SequenceKV = field(default_factory=SequenceKV)
    gen: torch.Generator | None = None


class Finisher:
    """A's side: finishes requests whose prefix ran elsewhere. `handle` is a transport handler."""

    def __init__(self, model: LlamaModel, max_requests: int = 256, busy: Callable[[], bool] = lambda: False,
                 token: str | None = None, host: Any = None, wake: Callable[[], None] = lambda: None,
                 prefill: Any = None, forward: Any = None) -> None:
        self.model = model
        self.forward = forward  # liveredirect.ForwardHost: serves sources' {"op": "forward"} sessions
        self.prefill = prefill  # prefill_server.PrefillServer: serves decode engines' {"op": "prefill"} (PD)
        self.token = token
        self.host = host  # cooperation.HostRows of this engine: pair sessions join its batch
        self.wake = wake  # wakes this engine's step loop when a pair step arrives
        self.connections = 0  # metric: activation connections accepted (pairs reuse theirs)
        self.pairs = 0
        self.busy = busy  # is this engine's own work queue non-empty (ZigZag: the peer pulls only when idle)
        self.max_requests = max_requests
        self.state: dict[str, _Remote] = {}
        self.layers_finished = 0  # metric: layers executed here for remote prefixes

    def step(self, header: Header, payload: bytes | bytearray) -> Header:
        req = str(header.get("req", ""))
        try:
            if header["op"] == "end":
                self.state.pop(req, None)
                return {"op": "ended", "req": req}
            if header["op"] == "poll":
                return {"op": "load", "idle": not self.busy()}
            if header["op"] != "act":
                raise ValueError(f"unknown op {header['op']!r}")
            layer, start = header.get("layer"), header.get("start")
            if not isinstance(layer, int) or not 0 <= layer <= self.model.shape.layers:
                raise ValueError(f"layer {layer!r} outside 0..{self.model.shape.layers}")
            if not isinstance(start, int) or start < 0:
                raise ValueError(f"start {start!r} must be a non-negative int")
            hidden = decode_activation(header, payload, self.model.shape.hidden).to(self.model.device, self.model.dtype)
            st = self.state.get(req)
            if st is None:
                if len(self.state) >= self.max_requests:
                    raise ValueError(f"too many split requests in flight ({self.max_requests})")
                p = header.get("params") or {}
                seed = p.get("seed")
                st = self.state[req] = _Remote(
                    gen=torch.Generator(device="cpu").manual_seed(int(seed)) if seed is not None else None
                )
            p = header.get("params") or {}
            params = SamplingParams(temperature=float(p.get("temperature", 0.0)), top_p=float(p.get("top_p", 1.0)))
            L = self.model.shape.layers
            out = self.model.run_layers(layer, L, hidden, st.kv, start)
            self.layers_finished += L - layer
            tok = sample(self.model.logits(out[-1:])[0].cpu(), params, st.gen)
            return {"op": "token", "req": req, "token": tok}
        except (ValueError, RuntimeError, KeyError) as e:
            self.state.pop(req, None)
            return {"op": "error", "req": req, "message": str(e)}

    async def handle(self, conn: Connection) -> None:
        self.connections += 1
        if self.token is not None:  # peerauth challenge–response: the token itself never crosses the wire
            try:
                admitted = await peerauth.accept(conn, self.token, "activation", timeout=10)
                await conn.send(admitted.welcome.header(), timeout=10)
            except TransportError as e:  # AuthError included (accept logged it and told the peer)
                log.warning("activation connection from %s rejected: %s", conn.peer, e)
                await conn.close()
                return
        else:  # no token, no handshake: the connection is a peer at once (not an evictable stranger)
            admit = getattr(conn, "admit", None)
            if admit is not None:
                admit()
        limit = MAX_ACT_TOKENS * self.model.shape.hidden * 4  # the largest activation a peer may send
        first = True
        while True:
            try:
                header, payload = await conn.recv(max_payload=limit)
            except TransportError:
                return
            if first and header.get("op") == "pair" and self.host is not None:
                from kascade_engine.live.pairsession import host_pair

                self.pairs += 1
                await host_pair(self.host, self.model, conn, header, self.pairs, self.wake, limit)
                return
            if first and header.get("op") == "forward" and self.forward is not None:
                await self.forward.handle(conn, header)  # a source hands us its queued requests (liveredirect.py)
                return
            if first and header.get("op") == "prefill" and self.prefill is not None:
                await self.prefill.handle(conn, header)  # disaggregated serving: KV goes back on this connection
                return
            first = False
            reply = await asyncio.to_thread(self.step, header, payload)
            try:
                await conn.send(reply)
            except TransportError:
                return


class SplitClient:
    """B's side: run layers 0..k-1 locally, the rest on A through `conn`."""

    def __init__(self, model: LlamaModel, conn: Connection) -> None:
        self.model, self.conn = model, conn

    async def hello(self, token: str) -> None:
        """Authenticate to a Finisher that requires a token (peerauth; AuthError names the refusal)."""
        await peerauth.join(self.conn, token, "activation", timeout=10)

    def _prefix(self, ids: list[int], kv: SequenceKV, start: int, k: int) -> torch.Tensor:
        return self.model.run_layers(0, k, self.model.embed(torch.tensor(ids, device=self.model.device)), kv, start)

    async def _zig(self, ids: list[int], kv: SequenceKV) -> tuple[torch.Tensor, int]:
        """Run the prompt through layers as they become resident until the peer is idle."""
        m = self.model
        h, done = m.embed(torch.tensor(ids, device=m.device)), 0
        while True:
            now = m.resident_prefix()
            if now > done:
                h = await asyncio.to_thread(m.run_layers, done, now, h, kv, 0)
                done = now
            if done == m.shape.layers:
                return h, done
            await self.conn.send({"op": "poll"})
            reply, _ = await self.conn.recv(timeout=60)
            if reply.get("idle"):
                return h, done
            await asyncio.sleep(0.002)

    async def _remote(self, req: str, start: int, k: int, hidden: torch.Tensor, params: SamplingParams) -> int:
        header, raw = encode_activation(req, start, k, hidden, params)
        await self.conn.send(header, raw)
        reply, _ = await self.conn.recv(timeout=60)
        if reply.get("op") != "token":
            raise RuntimeError(f"peer refused the activation: {reply.get('message', reply)}")
        return int(reply["token"])

    async def generate(self, req: str, prompt: list[int], params: SamplingParams, k: int,
                       eos: int | None = None, on_token: Callable[[int, bool], None] | None = None,
                       zigzag: bool = False) -> list[int]:
        if k > self.model.resident_prefix():
            raise ValueError(f"split at {k} layers but only {self.model.resident_prefix()} are resident")
        kv, ids, start = SequenceKV(), list(prompt), 0
        out: list[int] = []
        try:
            while len(out) < params.max_tokens:
                if zigzag and not out:
                    h, k = await self._zig(ids, kv)
                else:
                    h = await asyncio.to_thread(self._prefix, ids, kv, start, k)
                tok = await self._remote(req, start, k, h, params)
                out.append(tok)
                stop = tok == eos or tok in params.stop_token_ids
                if on_token is not None:
                    on_token(tok, stop or len(out) >= params.max_tokens)
                if stop:
                    break
                start += len(ids)
                ids = [tok]
        finally:
            await self.conn.send({"op": "end", "req": req})
            await self.conn.recv(timeout=60)
        return out


