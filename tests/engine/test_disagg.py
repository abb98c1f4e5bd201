"""Disaggregated serving between real engines: a decode engine D asks a prefill engine P (over P's data
port, after the token hello, plain TCP) to prefill; P ships the prompt's KV layer by layer while it
computes; D checks coverage + digest, adopts the sequence into its batch and decodes. Greedy output
equals the colocated engine's; anything that goes wrong falls back to a local prefill on D."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from splitref import collect, unsplit  # type: ignore[import-not-found]

from kascade_engine import peerauth
from kascade_engine.config import EngineConfig
from kascade_engine.instance import EngineInstance
from kascade_engine.kv_wire import KVShape, KVWireError, PrefillOp, kv_header, waited_s
from kascade_engine.sampling import SamplingParams
from kascade_engine.tokenizer import ByteTokenizer
from kascade_engine.transport import Connection
from kascade_engine.transport_tcp import TcpTransport

PROMPTS = [[11, 42, 7, 300, 5, 9, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [1, 2, 3],
           [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 17], [100], list(range(40, 77))]
TOKEN = "pd-token"


def _instance(ckpt: Path, blocks: Any, name: str, batch: int = 64, token: str = TOKEN) -> EngineInstance:
    cfg = EngineConfig(checkpoint=ckpt, model_name="tiny-llama", token=token, kv_tokens=2048,
                       max_batch_tokens=batch, instance=name)
    return EngineInstance(cfg, blocks.config, ByteTokenizer(), blocks)


class PD:
    """P serving its data port (the same Finisher.handle the CLI listens with) and D."""

    def __init__(self, p: EngineInstance, d: EngineInstance, listener: Any) -> None:
        self.p, self.d, self.listener = p, d, listener

    @property
    def peer(self) -> str:
        return f"127.0.0.1:{self.listener.port}"

    async def close(self) -> None:
        await self.d.close()
        await self.p.close()
        await self.listener.close()


async def _pd(ckpt: Path, blocks: Any, p_batch: int = 64, d_token: str = TOKEN) -> PD:
    p = _instance(ckpt, blocks, "p", batch=p_batch)
    d = _instance(ckpt, blocks, "d", token=d_token)
    p.serving.start()
    d.serving.start()
    listener = await TcpTransport().listen("127.0.0.1", 0, lambda c: p.finisher.handle(c))
    return PD(p, d, listener)


async def test_prefill_on_p_decode_on_d_equalsunsplit(tiny_ckpt, tiny_blocks) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=8)
    want = unsplit(tiny_blocks, PROMPTS, params)
    pd = await _pd(tiny_ckpt, tiny_blocks, p_batch=16)  # chunked on P: the long prompts take several steps
    chunks: list[int] = []
    schedule = pd.d.engine.scheduler.schedule

    def spy():  # type: ignore[no-untyped-def]
        batch = schedule()
        chunks.extend(w.n for w in batch.work)
        return batch

    pd.d.engine.scheduler.schedule = spy  # type: ignore[method-assign]
    try:
        rids = [pd.d.serving.submit(p, params, prefill=pd.peer) for p in PROMPTS]
        got = await asyncio.wait_for(asyncio.gather(*(collect(pd.d, r) for r in rids)), 120)
        assert got == want
        rp, ps = pd.d.remote_prefill, pd.p.prefill_server
        assert (rp.adopted, rp.fallbacks, ps.requests, ps.refused) == (len(PROMPTS), 0, len(PROMPTS), 0)
        s = pd.d.model.shape
        kv_bytes = sum(len(p) for p in PROMPTS) * 2 * s.layers * s.kv_heads * s.head_dim * 4  # float32 K and V
        assert rp.bytes_received == ps.bytes_sent == kv_bytes
        assert rp.link[pd.peer] > 0
        assert chunks and set(chunks) == {1}  # D never ran a prompt chunk: only decodes
        assert pd.p.engine.scheduler.idle and pd.d.engine.scheduler.idle
        assert pd.d.remote_prefill.pool.handshakes <= len(PROMPTS)  # connections are reused per peer
        # again: every connection is warm now, and the second round is as exact
        rids = [pd.d.serving.submit(p, params, prefill=pd.peer) for p in PROMPTS[:2]]
        got = await asyncio.wait_for(asyncio.gather(*(collect(pd.d, r) for r in rids)), 120)
        assert got == want[:2]
    finally:
        await pd.close()


async def test_kv_leaves_layer_by_layer_per_chunk(tiny_ckpt, tiny_blocks) -> None:  # type: ignore[no-untyped-def]
    """P's chunked prefill of a 37-token prompt in 16-token chunks sends K and V of every layer per chunk."""
    pd = await _pd(tiny_ckpt, tiny_blocks, p_batch=16)
    frames: list[tuple[int, int, str]] = []
    try:
        conn = await TcpTransport().connect("127.0.0.1", pd.listener.port)
        await peerauth.join(conn, TOKEN, "activation", timeout=10)  # raises unless welcomed with a valid proof
        from kascade_engine.prefill_server import kv_shape

        shape = kv_shape(pd.d)
        prompt = PROMPTS[4]
        await conn.send({"op": "prefill", "req": "r1", "tokens": prompt, "params": {}, **shape.to_header()})
        while True:
            h, payload = await conn.recv(timeout=60)
            if h["op"] != "kv":
                break
            assert len(payload) == shape.frame_bytes(h["n"])
            frames.append((h["start"], h["layer"], h["part"]))
        assert h["op"] == "kv_done" and h["frames"] == len(frames)
        L = shape.layers
        want = [(start, layer, part) for start in (0, 16, 32) for layer in range(L) for part in ("k", "v")]
        assert frames == want  # chunk by chunk, and inside each chunk layer by layer in compute order
        assert h["token"] == unsplit(tiny_blocks, [prompt], SamplingParams(max_tokens=1))[0][0]
        await conn.close()
    finally:
        await pd.close()


async def test_bad_prefill_requests_are_refused_naming_the_field(tiny_ckpt, tiny_blocks) -> None:  # type: ignore[no-untyped-def]
    pd = await _pd(tiny_ckpt, tiny_blocks)
    try:
        from kascade_engine.prefill_server import kv_shape

        shape = kv_shape(pd.d).to_header()
        conn = await TcpTransport().connect("127.0.0.1", pd.listener.port)
        await peerauth.join(conn, TOKEN, "activation", timeout=10)
        cases = [({"tokens": [1, 99999]}, "'tokens'"), ({"tokens": []}, "'tokens'"),
                 ({"tokens": [1], "kv_heads": 99}, "'kv_heads'"), ({"tokens": [1], "dtype": "float16"}, "'dtype'"),
                 ({"tokens": [1], "params": {"temperature": "hot"}}, "'params'")]
        for extra, field in cases:
            await conn.send({"op": "prefill", "req": "x", "params": {}, **shape, **extra})
            h, _ = await conn.recv(timeout=30)
            assert h["op"] == "error" and field in h["message"], (extra, h)
        assert pd.p.prefill_server.refused == len(cases)
        # the same connection still serves a good request after the refusals
        await conn.send({"op": "prefill", "req": "ok", "tokens": [1, 2, 3], "params": {}, **shape})
        while (h := (await conn.recv(timeout=60))[0])["op"] == "kv":
            pass
        assert h["op"] == "kv_done"
        await conn.close()
    finally:
        await pd.close()


async def test_failures_fall_back_to_local_prefill_with_the_same_output(tiny_ckpt, tiny_blocks) -> None:  # type: ignore[no-untyped-def]
    """A dead peer, a peer that refuses the hello, and a peer whose KV does not match its digest: every
    request still completes on D with the colocated output, counted as a fallback."""
    params = SamplingParams(max_tokens=6)
    want = unsplit(tiny_blocks, PROMPTS[:2], params)
    pd = await _pd(tiny_ckpt, tiny_blocks, d_token="wrong-token")  # P refuses D's hello
    shape: KVShape | None = None

    lied = 0

    async def liar(conn: Connection) -> None:  # a peer (it holds D's token), then sends KV whose digest is wrong
        admitted = await peerauth.accept(conn, "wrong-token", "activation", timeout=10)
        await conn.send(admitted.welcome.header())
        h, _ = await conn.recv(timeout=10)
        assert shape is not None
        n = len(h["tokens"])
        for layer in range(shape.layers):
            for part in ("k", "v"):
                await conn.send(kv_header(h["req"], layer, 0, n, part, shape), bytes(shape.frame_bytes(n)))
        await conn.send({"op": "kv_done", "req": h["req"], "token": 1, "frames": 0, "bytes": 0, "digest": "00"})
        nonlocal lied
        lied += 1
        await conn.recv(timeout=30)

    from kascade_engine.prefill_server import kv_shape

    shape = kv_shape(pd.d)
    bad = await TcpTransport().listen("127.0.0.1", 0, liar)
    dead = await TcpTransport().listen("127.0.0.1", 0, lambda c: c.close())
    dead_port = dead.port
    await dead.close()
    try:
        for peer in (pd.peer, f"127.0.0.1:{bad.port}", f"127.0.0.1:{dead_port}"):
            rids = [pd.d.serving.submit(p, params, prefill=peer) for p in PROMPTS[:2]]
            got = await asyncio.wait_for(asyncio.gather(*(collect(pd.d, r) for r in rids)), 120)
            assert got == want, peer
        assert (pd.d.remote_prefill.adopted, pd.d.remote_prefill.fallbacks) == (0, 6)
        assert pd.p.prefill_server.requests == 0
        assert lied == 2  # the liar was reached (authenticated), not timed out
    finally:
        await bad.close()
        await pd.close()


async def test_a_rogue_prefill_address_learns_neither_the_token_nor_the_prompt(tiny_ckpt, tiny_blocks) -> None:  # type: ignore[no-untyped-def]
    """`X-Kascade-Prefill` names any address: D must not hand its engine token (or the prompt) to a
    listener there. The rogue sees a hello it cannot use, cannot prove the token, gets nothing more;
    the request is prefilled on D with the colocated output."""
    from kascade_engine.transport import PREFIX, decode_header, decode_prefix, encode_prefix

    params = SamplingParams(max_tokens=6)
    want = unsplit(tiny_blocks, PROMPTS[:1], params)
    seen = bytearray()
    closed = asyncio.Event()

    async def rogue(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"".join(encode_prefix(peerauth.Challenge(bytes(32)).header(), 0)))
        hlen, _ = decode_prefix(await r.readexactly(PREFIX.size))
        assert decode_header(await r.readexactly(hlen))["op"] == "hello"
        w.write(b"".join(encode_prefix({"op": "welcome", "proof": "ab" * 32}, 0)))
        await w.drain()
        seen.extend(await asyncio.wait_for(r.read(), 30))  # everything D sends until it closes
        w.close()
        closed.set()

    server = await asyncio.start_server(rogue, "127.0.0.1", 0)
    pd = await _pd(tiny_ckpt, tiny_blocks)
    try:
        peer = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        rid = pd.d.serving.submit(PROMPTS[0], params, prefill=peer)
        assert await asyncio.wait_for(collect(pd.d, rid), 60) == want[0]
        assert (pd.d.remote_prefill.adopted, pd.d.remote_prefill.fallbacks) == (0, 1)
        await asyncio.wait_for(closed.wait(), 30)  # D closed the connection: `seen` is all it sent
        assert TOKEN.encode() not in seen and b"prefill" not in seen and b"tokens" not in seen
        assert not pd.d.remote_prefill.pool.idle.get(peer)  # the refused connection is not kept
    finally:
        server.close()
        await pd.close()


@pytest.mark.parametrize("max_tokens", [1, 2])
async def test_short_requests_finish_at_the_first_token(tiny_ckpt, tiny_blocks, max_tokens: int) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=max_tokens)
    want = unsplit(tiny_blocks, PROMPTS[:1], params)
    pd = await _pd(tiny_ckpt, tiny_blocks)
    try:
        rid = pd.d.serving.submit(PROMPTS[0], params, prefill=pd.peer)
        assert await asyncio.wait_for(collect(pd.d, rid), 60) == want[0]
        assert pd.d.engine.scheduler.idle and not pd.d.engine.requests
    finally:
        await pd.close()


async def test_converted_decoder_prefills_for_another_decoder_within_its_chunk_budget(tiny_ckpt, tiny_blocks) -> None:  # type: ignore[no-untyped-def]
    """TokenScale's convertible decoder: engine C (a decoder with its own decodes running) is converted with a
    prefill chunk budget of 8 tokens per step; decoder D's requests prefill on C over the data port; C never
    schedules more than 8 prompt tokens in a step, and every output equals the colocated engine's."""
    from kascade_planner.engine_api import ConvertRequest, WireError

    params = SamplingParams(max_tokens=6)
    want = unsplit(tiny_blocks, PROMPTS, params)
    pd = await _pd(tiny_ckpt, tiny_blocks)
    c = pd.p
    st = c.convert(ConvertRequest(8, 1000.0)).extra  # the operator reads both back in status
    assert st["prefillChunkTokens"] == 8 and st["stepBudgetMs"] == 1000.0 and c.engine.limits.step_budget_s == 1.0
    chunks: list[int] = []
    schedule = c.engine.scheduler.schedule

    def spy():  # type: ignore[no-untyped-def]
        batch = schedule()
        chunks.append(sum(w.n for w in batch.work if w.n > 1 or w.start == 0))
        return batch

    c.engine.scheduler.schedule = spy  # type: ignore[method-assign]
    try:
        own = [c.serving.submit(p, params) for p in PROMPTS[:2]]  # C's own traffic, decoding meanwhile
        rids = [pd.d.serving.submit(p, params, prefill=pd.peer) for p in PROMPTS]
        got = await asyncio.wait_for(asyncio.gather(*(collect(pd.d, r) for r in rids),
                                                    *(collect(c, r) for r in own)), 120)
        assert got == want + want[:2]
        assert pd.d.remote_prefill.adopted == len(PROMPTS) and c.prefill_server.requests == len(PROMPTS)
        assert max(chunks) <= 8 and sum(chunks) >= sum(len(p) for p in PROMPTS)
        assert c.engine.cost.token_s is not None  # its own steps timed the cost of a prompt token
        st = c.convert(ConvertRequest(None)).extra
        assert "prefillChunkTokens" not in st and "stepBudgetMs" not in st  # taken back: no cap, no budget
        assert c.engine.limits.prefill_chunk_tokens is None and c.engine.limits.step_budget_s is None
    finally:
        await pd.close()
    for bad in ({}, {"prefillChunkTokens": 0}, {"prefillChunkTokens": "8"}, {"prefillChunkTokens": 8, "x": 1},
                {"prefillChunkTokens": 8, "stepBudgetMs": 0}, {"prefillChunkTokens": 8, "stepBudgetMs": True}):
        with pytest.raises(WireError) as e:
            ConvertRequest.from_dict(bad)
        assert e.value.field in ("prefillChunkTokens", "x", "stepBudgetMs")
    assert ConvertRequest.from_dict(ConvertRequest(8, 25.0).to_dict()) == ConvertRequest(8, 25.0)


async def test_the_link_rate_counts_the_wire_not_the_prefillers_compute(tiny_ckpt, tiny_blocks) -> None:  # type: ignore[no-untyped-def]
    """A prefill peer that computes 0.1 s per layer (a queue, a slow CPU) and sends each layer's KV at once
    over loopback: D's network velocity must be the link's (bytes over the frames' time on the wire), not
    the KV bytes over the 0.7 s P spent computing between frames."""
    from kascade_engine.kv_wire import digest
    from kascade_engine.prefill_server import kv_shape

    d = _instance(tiny_ckpt, tiny_blocks, "d")
    d.serving.start()
    shape = kv_shape(d)
    gaps = 0.0

    async def slow_p(conn: Connection) -> None:
        nonlocal gaps
        admitted = await peerauth.accept(conn, TOKEN, "activation", timeout=10)
        await conn.send(admitted.welcome.header())
        h, _ = await conn.recv(timeout=10)
        n, hasher, sent = len(h["tokens"]), digest(), 0
        for layer in range(shape.layers):
            if layer:
                await asyncio.sleep(0.1)  # computing the next layer: the link idles
                gaps += 0.1
            for part in ("k", "v"):
                payload = bytes(shape.frame_bytes(n))
                hasher.update(payload)
                sent += len(payload)
                await conn.send(kv_header(h["req"], layer, 0, n, part, shape), payload)
        await conn.send({"op": "kv_done", "req": h["req"], "token": 1, "frames": 2 * shape.layers, "bytes": sent,
                         "digest": hasher.hexdigest()})
        await conn.recv(timeout=30)

    p = await TcpTransport().listen("127.0.0.1", 0, slow_p)
    peer = f"127.0.0.1:{p.port}"
    try:
        rid = d.serving.submit(PROMPTS[4], SamplingParams(max_tokens=2), prefill=peer)
        await asyncio.wait_for(collect(d, rid), 60)
        rp = d.remote_prefill
        assert rp.adopted == 1 and gaps > 0
        kv = len(PROMPTS[4]) * 2 * shape.layers * shape.frame_bytes(1)
        assert rp.bytes_received == kv
        assert rp.link[peer] > 20 * kv / gaps  # the span would give about kv / gaps: P's compute
    finally:
        await p.close()
        await d.close()


class _NoRoom:
    """A converted decoder's step-cost model beside a big batch: its decodes alone fill the step budget, so a
    prompt chunk gets 0 tokens in every step that decodes (StepCost.chunk_fits' answer there)."""

    token_s = 1e-3

    def chunk_fits(self, budget_s: float, shape: Any, start: int, n: int) -> int:
        return 0


async def test_a_converted_decoder_hands_a_prompt_without_room_to_the_prefill_engine(tiny_ckpt, tiny_blocks) -> None:  # type: ignore[no-untyped-def]
    """D, converted, decodes four long streams; its step budget leaves a prompt chunk 0 tokens beside them. A
    prompt D prefills itself, with the router's fallback prefill engine P (PREFILL_FALLBACK_HEADER), has made
    no progress after the hand-back bound and has no token out: D takes it out of its batch and P prefills it,
    its KV comes back, D decodes it. Greedy output equals the colocated engine's, and it is done while the
    streams still run. Without the hand-back it waits on D (0 tokens a step) until the streams end. A prompt
    that has room (no decodes beside it) is not handed back, nor one whose engine is not converted."""
    from kascade_planner.engine_api import ConvertRequest

    params = SamplingParams(max_tokens=8)
    want = unsplit(tiny_blocks, PROMPTS[:2], params)
    long = SamplingParams(max_tokens=480)  # the tiny model's 512 positions hold it after a short prompt
    pd = await _pd(tiny_ckpt, tiny_blocks)
    d = pd.d
    try:
        # not converted: the fallback is only a name, the prompt prefills here
        assert await collect(d, d.serving.submit(PROMPTS[0], params, fallback=pd.peer)) == want[0]
        streams = [d.serving.submit([7 + i, 8, 9], long) for i in range(4)]
        ends: dict[str, float] = {}

        async def drain(rid: str) -> None:
            async for ev in d.serving.tokens(rid):
                if ev.finished:
                    ends[rid] = time.monotonic()

        tasks = [asyncio.create_task(drain(r)) for r in streams]
        while not all(d.engine.requests.get(r) and d.engine.requests[r].out for r in streams):
            await asyncio.sleep(0.005)
        st = d.convert(ConvertRequest(16, 30.0, hand_back_ms=100.0)).extra
        assert st["handBackMs"] == 100.0
        d.engine.scheduler.cost = _NoRoom()  # type: ignore[assignment]
        arrivals: list[float | None] = []  # when P queues the handed-back prompt (its Seq.arrived)
        p_submit = pd.p.engine.submit

        def spy(*a: Any, **kw: Any) -> str:
            arrivals.append(kw.get("arrived"))
            return p_submit(*a, **kw)

        pd.p.engine.submit = spy  # type: ignore[method-assign]
        t0 = time.monotonic()
        rid = d.serving.submit(PROMPTS[0], params, fallback=pd.peer)
        got = await asyncio.wait_for(collect(d, rid), 60)
        t_done = time.monotonic()
        assert got == want[0]
        # P queued it by its arrival at D (one monotonic clock in this process), not at the hand-back >= 0.1 s later
        assert len(arrivals) == 1 and arrivals[0] is not None and abs(arrivals[0] - t0) < 0.05, (arrivals, t0)
        assert not ends, "the streams ended before the handed-back prompt: nothing was stranded"
        assert t_done - t0 >= 0.1  # held for the bound first
        assert d.handback.handed == 1 and pd.p.prefill_server.requests == 1 and d.remote_prefill.adopted == 1
        assert d.remote_prefill.fallbacks == 0
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        # room again (no decodes beside it: the token cap alone): prefilled here, not handed back
        assert await collect(d, d.serving.submit(PROMPTS[1], params, fallback=pd.peer)) == want[1]
        assert d.handback.handed == 1 and pd.p.prefill_server.requests == 1
        assert d.convert(ConvertRequest(None)).extra.get("handBackMs") is None
    finally:
        await pd.close()
    assert ConvertRequest.from_dict({"prefillChunkTokens": 8, "handBackMs": 250}) == ConvertRequest(8, None, 250.0)
    for bad in (0, -1, True, "1", float("inf")):
        with pytest.raises(Exception) as e:
            ConvertRequest.from_dict({"prefillChunkTokens": 8, "handBackMs": bad})
        assert "handBackMs" in str(e.value)


class _SlowRoom:
    """A converted decoder's step-cost model that gives a prompt one token per `every_s` of steps that decode:
    a prompt progresses in every hand-back bound, slowly (time-based, so the pace does not depend on how fast
    this machine runs a step)."""

    token_s = 1e-3

    def __init__(self, every_s: float) -> None:
        self.every_s, self.last = every_s, 0.0

    def chunk_fits(self, budget_s: float, shape: Any, start: int, n: int) -> int:
        now = time.monotonic()
        if now - self.last < self.every_s:
            return 0
        self.last = now
        return min(n, 1)


async def test_a_converted_decoder_hands_back_a_prompt_that_progresses_slower_than_the_remote_path(tiny_ckpt, tiny_blocks) -> None:  # type: ignore[no-untyped-def]
    """The production rule: a prompt that progresses, but at a pace whose predicted finish here (tokens left /
    the rate over the last bound) is later than what a remote prefill on P took lately (measured on real
    remote prefills), is handed back; the same pace with a slower remote path stays. Without the rule (no
    progress only) the slow prompt is never handed back."""
    from kascade_planner.engine_api import ConvertRequest

    params = SamplingParams(max_tokens=8)
    prompt = list(range(40, 77))  # 37 tokens
    want = unsplit(tiny_blocks, [prompt], params)
    long = SamplingParams(max_tokens=480)
    pd = await _pd(tiny_ckpt, tiny_blocks)
    d = pd.d
    try:
        # the remote path, measured: two prompts prefilled on P for D
        for q in PROMPTS[:2]:
            await collect(d, d.serving.submit(q, params, prefill=pd.peer))
        took = d.remote_prefill.took[pd.peer]
        assert 0 < took < 5
        streams = [d.serving.submit([7 + i, 8, 9], long) for i in range(4)]
        tasks = [asyncio.create_task(collect(d, r)) for r in streams]
        while not all(d.engine.requests.get(r) and d.engine.requests[r].out for r in streams):
            await asyncio.sleep(0.005)
        d.convert(ConvertRequest(16, 30.0, hand_back_ms=100.0))
        d.engine.scheduler.cost = _SlowRoom(0.02)  # type: ignore[assignment]  # ~50 tok/s: 37 tokens ~0.7 s
        rid = d.serving.submit(prompt, params, fallback=pd.peer)
        assert await asyncio.wait_for(collect(d, rid), 60) == want[0]
        assert d.handback.handed == 1 and d.remote_prefill.fallbacks == 0
        assert not all(t.done() for t in tasks)
        # a remote path slower than any local pace: the same slow prompt stays and finishes here
        d.remote_prefill.took[pd.peer] = 1e6
        served = pd.p.prefill_server.requests
        rid = d.serving.submit(prompt, params, fallback=pd.peer)
        assert await asyncio.wait_for(collect(d, rid), 120) == want[0]
        assert d.handback.handed == 1 and pd.p.prefill_server.requests == served
        for t in tasks:  # the clients leave (their work, keeping D busy, is done): that aborts the streams
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await pd.close()


def test_the_hand_back_verdict() -> None:
    from kascade_planner.conversion import hand_back_verdict as verdict

    assert verdict(100, 0, 0.25, None) is not None  # no progress: always
    assert verdict(100, 0, 0.25, 10.0) is not None
    assert verdict(100, 10, 0.25, None) is None  # progress, remote path unmeasured: stays
    assert verdict(100, 10, 0.25, 1.0) is not None  # 2.5 s left here against 1 s there
    assert verdict(100, 10, 0.25, 3.0) is None
    assert verdict(0, 10, 0.25, 0.001) is None  # done here


def test_the_prefill_op_carries_the_time_a_prompt_waited() -> None:
    shape = KVShape(2, 1, 4, "float32", 4)
    h = PrefillOp("r", [1, 2], 0.0, 1.0, None, shape, 1.25).to_header()
    assert h["op"] == "prefill" and waited_s(h) == 1.25 and shape.mismatch(h) is None
    assert "waited_s" not in PrefillOp("r", [1], 0.0, 1.0, 7, shape).to_header()
    assert waited_s({}) == 0.0
    for bad in (-1, True, "1", float("inf"), float("nan")):
        with pytest.raises(KVWireError, match="waited_s"):
            waited_s({"waited_s": bad})


def test_the_remote_path_estimate_follows_a_growing_queue() -> None:
    """What the hand-back compares with: the moving average of landed remote prefills, or the age of one still
    in flight when that is longer (a burst's queue at the prefill engine grows before any of it lands)."""
    from types import SimpleNamespace

    from kascade_engine.remote_prefill import RemotePrefill

    rp = RemotePrefill(SimpleNamespace(transport=None, config=SimpleNamespace(token="t")))  # type: ignore[arg-type]
    assert rp.expected_s("p:1") is None
    rp.took["p:1"] = 0.3
    assert rp.expected_s("p:1") == 0.3
    rp.pending["r1"] = ("p:1", time.monotonic() - 1.5)  # sent 1.5 s ago, not landed
    rp.pending["r2"] = ("q:2", time.monotonic() - 9.0)  # another peer's queue says nothing of p:1
    assert 1.5 <= rp.expected_s("p:1") < 2.5  # type: ignore[operator]
    del rp.took["p:1"]
    assert 1.5 <= rp.expected_s("p:1") < 2.5  # type: ignore[operator]
