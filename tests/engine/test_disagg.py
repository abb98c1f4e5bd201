"""Disaggregated serving between real engines: a decode engine D asks a prefill engine P (over P's data
port, after the token hello, plain TCP) to prefill; P ships the prompt's KV layer by layer while it
computes; D checks coverage + digest, adopts the sequence into its batch and decodes. Greedy output
equals the colocated engine's; anything that goes wrong falls back to a local prefill on D. A converted
decoder's hand-back of a prompt it prefills itself is in test_handback.py."""

from __future__ import annotations

import asyncio
import time

import pytest
from pdpair import PROMPTS, TOKEN, instance, pd_pair
from splitref import collect, unsplit

from kascade_engine.batch.sampling import SamplingParams
from kascade_engine.net import peerauth
from kascade_engine.net.pacing import TokenBucket
from kascade_engine.net.transport import Connection
from kascade_engine.net.transport_tcp import TcpTransport
from kascade_engine.pd.kv_wire import KVShape, kv_header

DEADLINE_S = 120.0  # the longest a test here waits for its requests (a loaded 2-core machine takes seconds)


async def test_prefill_on_p_decode_on_d_equalsunsplit(tiny_ckpt, tiny_blocks) -> None:
    params = SamplingParams(max_tokens=8)
    want = unsplit(tiny_blocks, PROMPTS, params)
    pd = await pd_pair(tiny_ckpt, tiny_blocks, p_batch=16)  # chunked on P: the long prompts take several steps
    chunks: list[int] = []
    schedule = pd.d.engine.scheduler.schedule

    def spy():
        batch = schedule()
        chunks.extend(w.n for w in batch.work)
        return batch

    pd.d.engine.scheduler.schedule = spy
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


async def test_kv_counts_against_the_engines_egress_cap(tiny_ckpt, tiny_blocks) -> None:
    """P's KV frames go at once and charge its one egress bucket (--transfer-max-mbps), the one its weight plans
    wait on: every KV byte it ships is in the bucket (a frozen clock: no refill)."""
    pd = await pd_pair(tiny_ckpt, tiny_blocks)
    pd.p.egress = TokenBucket(1e6, burst=1, clock=lambda: 0.0)  # the engine's own bucket, on a frozen clock
    try:
        rids = [pd.d.serving.submit(p, SamplingParams(max_tokens=2), prefill=pd.peer) for p in PROMPTS]
        await asyncio.wait_for(asyncio.gather(*(collect(pd.d, r) for r in rids)), 120)
        sent = pd.p.prefill_server.bytes_sent
        assert sent > 0 and pd.d.remote_prefill.adopted == len(PROMPTS)
        assert pd.p.egress.delay(0) == pytest.approx((sent - 1) / 1e6)  # weights would wait for every KV byte
    finally:
        await pd.close()


async def test_kv_leaves_layer_by_layer_per_chunk(tiny_ckpt, tiny_blocks) -> None:
    """P's chunked prefill of a 37-token prompt in 16-token chunks sends K and V of every layer per chunk."""
    pd = await pd_pair(tiny_ckpt, tiny_blocks, p_batch=16)
    frames: list[tuple[int, int, str]] = []
    try:
        conn = await TcpTransport().connect("127.0.0.1", pd.listener.port)
        await peerauth.join(conn, TOKEN, "activation", timeout=10)  # raises unless welcomed with a valid proof
        from kascade_engine.pd.prefill_server import kv_shape

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


async def test_kv_leaves_while_the_next_layer_computes(tiny_ckpt, tiny_blocks) -> None:
    """Layer by layer AS prefill proceeds, not after it: with P's layers paced at 80 ms (an emulated accelerator),
    the first layer's K and V reach D about three layer times before the last layer's and `kv_done`. Shipped
    after the whole step, every frame would land within a few ms of `kv_done`."""
    layer_s = 0.08
    pd = await pd_pair(tiny_ckpt, tiny_blocks, p_layer_ms=layer_s * 1e3)
    try:
        conn = await TcpTransport().connect("127.0.0.1", pd.listener.port)
        await peerauth.join(conn, TOKEN, "activation", timeout=10)
        from kascade_engine.pd.prefill_server import kv_shape

        shape = kv_shape(pd.d)
        await conn.send({"op": "prefill", "req": "r1", "tokens": PROMPTS[0], "params": {}, **shape.to_header()})
        first: dict[int, float] = {}
        while True:
            h, _ = await conn.recv(timeout=60)
            now = time.monotonic()
            if h["op"] != "kv":
                break
            first.setdefault(h["layer"], now)
        assert h["op"] == "kv_done" and sorted(first) == list(range(shape.layers))
        assert now - first[0] >= (shape.layers - 1) * layer_s * 0.8, (now - first[0], first)
        gaps = [first[i + 1] - first[i] for i in range(shape.layers - 1)]
        assert min(gaps) >= layer_s * 0.5, gaps  # one layer's compute between one layer's KV and the next's
        await conn.close()
    finally:
        await pd.close()


async def test_bad_prefill_requests_are_refused_naming_the_field(tiny_ckpt, tiny_blocks) -> None:
    pd = await pd_pair(tiny_ckpt, tiny_blocks)
    try:
        from kascade_engine.pd.prefill_server import kv_shape

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


async def test_failures_fall_back_to_local_prefill_with_the_same_output(tiny_ckpt, tiny_blocks) -> None:
    """A dead peer, a peer that refuses the hello, and a peer whose KV does not match its digest: every
    request still completes on D with the colocated output, counted as a fallback."""
    params = SamplingParams(max_tokens=6)
    want = unsplit(tiny_blocks, PROMPTS[:2], params)
    pd = await pd_pair(tiny_ckpt, tiny_blocks, d_token="wrong-token")  # P refuses D's hello
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

    from kascade_engine.pd.prefill_server import kv_shape

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


async def test_a_rogue_prefill_address_learns_neither_the_token_nor_the_prompt(tiny_ckpt, tiny_blocks) -> None:
    """`X-Kascade-Prefill` names any address: D must not hand its engine token (or the prompt) to a
    listener there. The rogue sees a hello it cannot use, cannot prove the token, gets nothing more;
    the request is prefilled on D with the colocated output."""
    from kascade_engine.net.transport import PREFIX, decode_header, decode_prefix, encode_prefix

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
    pd = await pd_pair(tiny_ckpt, tiny_blocks)
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
async def test_short_requests_finish_at_the_first_token(tiny_ckpt, tiny_blocks, max_tokens: int) -> None:
    params = SamplingParams(max_tokens=max_tokens)
    want = unsplit(tiny_blocks, PROMPTS[:1], params)
    pd = await pd_pair(tiny_ckpt, tiny_blocks)
    try:
        rid = pd.d.serving.submit(PROMPTS[0], params, prefill=pd.peer)
        assert await asyncio.wait_for(collect(pd.d, rid), 60) == want[0]
        assert pd.d.engine.scheduler.idle and not pd.d.engine.requests
    finally:
        await pd.close()


@pytest.mark.parametrize("p_layer_ms", [0.0, 20.0], ids=["fast", "slow-steps"])
async def test_converted_decoder_prefills_for_another_decoder_within_its_chunk_budget(tiny_ckpt, tiny_blocks,
                                                                                       p_layer_ms: float) -> None:
    """TokenScale's convertible decoder: engine C (a decoder with its own decodes running) is converted with a
    prefill chunk budget of 8 tokens per step; decoder D's requests prefill on C over the data port; C never
    schedules more than 8 prompt tokens in a step, and every output equals the colocated engine's.

    C keeps every prompt: the hand-back rule (test_handback.py) would give back a prompt that arrives before
    its warm-up probe measured the prefill rate, or that waits in its FCFS queue (8 tokens a step, ~10 steps
    for all) with no progress for the bound; how long that is in steps depends on the machine's speed (a slow
    step handed back 2 of 5 under load, every one with 20 ms layers). So D sends once the probe is done, and
    the bound is set past the test's own deadline."""
    from kascade_planner.engine_api import ConvertRequest, WireError

    params = SamplingParams(max_tokens=6)
    want = unsplit(tiny_blocks, PROMPTS, params)
    pd = await pd_pair(tiny_ckpt, tiny_blocks, p_layer_ms=p_layer_ms)
    c = pd.p
    st = c.convert(ConvertRequest(8, 1000.0, hand_back_ms=DEADLINE_S * 1e3)).extra  # the operator reads them back
    assert st["prefillChunkTokens"] == 8 and st["stepBudgetMs"] == 1000.0 and c.engine.limits.step_budget_s == 1.0
    assert st["handBackMs"] == DEADLINE_S * 1e3
    chunks: list[int] = []
    schedule = c.engine.scheduler.schedule

    def spy():
        batch = schedule()
        chunks.append(sum(w.n for w in batch.work if w.n > 1 or w.start == 0))
        return batch

    c.engine.scheduler.schedule = spy
    try:
        own = [c.serving.submit(p, params) for p in PROMPTS[:2]]  # C's own traffic, decoding meanwhile
        while c.probe.rid is not None:  # its warm-up: the prefill rate the arrival verdict reads
            await asyncio.sleep(0.01)
        assert c.probe.ended[-1][0] == "measured"
        rids = [pd.d.serving.submit(p, params, prefill=pd.peer) for p in PROMPTS]
        got = await asyncio.wait_for(asyncio.gather(*(collect(pd.d, r) for r in rids),
                                                    *(collect(c, r) for r in own)), DEADLINE_S)
        assert got == want + want[:2]
        assert (c.handback.handed, pd.d.remote_prefill.handed_back) == (0, 0)
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


async def test_the_link_rate_counts_the_wire_not_the_prefillers_compute(tiny_ckpt, tiny_blocks) -> None:
    """A prefill peer that computes 0.1 s per layer (a queue, a slow CPU) and sends each layer's KV at once
    over loopback: D's network velocity must be the link's (bytes over the frames' time on the wire), not
    the KV bytes over the 0.7 s P spent computing between frames."""
    from kascade_engine.pd.kv_wire import digest
    from kascade_engine.pd.prefill_server import kv_shape

    d = instance(tiny_ckpt, tiny_blocks, "d")
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
        await asyncio.sleep(0.15)  # P is computing: the request is about to join D's batch, and D's room counts it
        assert d.engine.scheduler.joining == {rid: len(PROMPTS[4])}
        await asyncio.wait_for(collect(d, rid), 60)
        rp = d.remote_prefill
        assert rp.adopted == 1 and gaps > 0 and d.engine.scheduler.joining == {}
        kv = len(PROMPTS[4]) * 2 * shape.layers * shape.frame_bytes(1)
        assert rp.bytes_received == kv
        assert rp.link[peer] > 20 * kv / gaps  # the span would give about kv / gaps: P's compute
    finally:
        await p.close()
        await d.close()


async def test_a_hung_prefiller_falls_back_within_the_deadline_and_turns_suspect(tiny_ckpt, tiny_blocks) -> None:  # type: ignore[no-untyped-def]
    """Issue 38 defect 4: a prefill engine that takes D's prefill op and then answers nothing (a SIGSTOPped one)
    must not hold the request for the 300 s frame timeout: past the first-frame deadline D closes the connection,
    prefills locally (a counted fallback, the colocated output) and holds the peer suspect, so the next request
    goes local at once without dialling it."""
    params = SamplingParams(max_tokens=6)
    want = unsplit(tiny_blocks, PROMPTS[:1], params)
    ops: list[str] = []
    hung: list[Connection] = []

    async def stopped(conn: Connection) -> None:  # authenticates (it holds the token), takes the op, then hangs
        admitted = await peerauth.accept(conn, TOKEN, "activation", timeout=10)
        await conn.send(admitted.welcome.header())
        h, _ = await conn.recv(timeout=10)
        ops.append(h["op"])
        hung.append(conn)
        await asyncio.sleep(3600)

    server = await TcpTransport().listen("127.0.0.1", 0, stopped)
    pd = await pd_pair(tiny_ckpt, tiny_blocks)
    rp = pd.d.remote_prefill
    rp.deadline.default_s = rp.deadline.floor_s = 1.0  # nothing measured of this peer: the configured default
    try:
        peer = f"127.0.0.1:{server.port}"
        t0 = time.monotonic()
        rid = pd.d.serving.submit(PROMPTS[0], params, prefill=peer)
        assert await asyncio.wait_for(collect(pd.d, rid), 20) == want[0]
        assert 1.0 <= time.monotonic() - t0 < 10.0  # the deadline, not the 300 s frame timeout
        assert (rp.adopted, rp.fallbacks, ops) == (0, 1, ["prefill"])
        assert rp.suspect_s(peer) > 0 and not rp.pool.idle.get(peer)  # suspect; the hung connection not pooled
        t1 = time.monotonic()
        rid = pd.d.serving.submit(PROMPTS[0], params, prefill=peer)
        assert await asyncio.wait_for(collect(pd.d, rid), 20) == want[0]
        assert time.monotonic() - t1 < 1.0 and (rp.fallbacks, ops) == (2, ["prefill"])  # not dialled again
    finally:
        await pd.close()
        for c in hung:
            await c.close()
        await server.close()
