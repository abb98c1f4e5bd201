"""Split execution: k layers on a loading engine B (this process), the rest on a full engine A (a real
`kascade engine serve` process) over the TCP transport, gives exactly the single-engine tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kascade_engine.batch.engine import Engine
from kascade_engine.batch.model import LlamaModel
from kascade_engine.batch.sampling import SamplingParams
from kascade_engine.live.activation import encode_activation
from kascade_engine.live.split import Finisher, SplitClient
from kascade_engine.net.transport_tcp import TcpTransport
from kascade_engine.weights.blocks import pack_checkpoint


def _partial(blocks, k: int) -> LlamaModel:
    m = LlamaModel(blocks.config)
    for bid in ("embed", *(f"layer.{i}" for i in range(k))):
        m.add_block(bid, blocks.blocks[bid].tensors())
    return m


def _single(blocks, prompt: list[int], params: SamplingParams) -> list[int]:
    m = LlamaModel(blocks.config)
    for b in blocks.blocks.values():
        m.add_block(b.id, b.tensors())
    return Engine(m).generate(prompt, params)


async def _split_with(engine, model, req: str, prompt: list[int], params: SamplingParams, k: int) -> list[int]:
    """Run a request split with a real engine process: our first k layers here, the rest there."""
    conn = await TcpTransport().connect("127.0.0.1", engine.act)
    try:
        client = SplitClient(model, conn)
        await client.hello(engine.token)  # the engine's activation port needs the installation token
        return await client.generate(req, prompt, params, k)
    finally:
        await conn.close()


@pytest.mark.parametrize("k", [0, 1, 2, 4])
async def test_split_over_tcp_between_processes(engine_a, tiny_blocks, k: int) -> None:
    prompt, params = [11, 42, 7, 300, 5], SamplingParams(max_tokens=8)
    want = _single(tiny_blocks, prompt, params)
    assert len(set(want)) > 1  # a degenerate model would make the comparison meaningless
    b = _partial(tiny_blocks, k)
    assert b.resident_prefix() == k and not b.complete
    assert await _split_with(engine_a, b, f"r{k}", prompt, params, k) == want


async def test_split_with_sampling_seed_matches(engine_a, tiny_blocks) -> None:
    prompt, params = [1, 2, 3], SamplingParams(max_tokens=6, temperature=0.9, seed=1234)
    want = _single(tiny_blocks, prompt, params)
    assert await _split_with(engine_a, _partial(tiny_blocks, 2), "seeded", prompt, params, 2) == want


def test_finisher_rejects_bad_activations(tiny_blocks) -> None:
    full = _partial(tiny_blocks, 4)
    full.add_block("head", tiny_blocks.blocks["head"].tensors())
    f = Finisher(full)
    h, raw = encode_activation("x", 0, 2, torch.zeros(3, 64), SamplingParams())
    assert f.step(h, raw)["op"] == "token"
    assert "payload has 5 bytes" in f.step({**h, "req": "y"}, b"12345")["message"]
    assert "hidden size 32" in f.step({**h, "req": "y", "shape": [3, 32]}, raw)["message"]
    assert "layer 9" in f.step({**h, "req": "y", "layer": 9}, raw)["message"]
    assert "KV holds 3 positions" in f.step(h, raw)["message"]  # replayed position for request x
    assert "unknown op" in f.step({"op": "bogus", "req": "z"}, b"")["message"]


def test_split_beyond_resident_prefix_refused(tiny_blocks) -> None:
    import asyncio

    with pytest.raises(ValueError, match="only 1 are resident"):
        asyncio.run(SplitClient(_partial(tiny_blocks, 1), None).generate("r", [1], SamplingParams(), 3))  # type: ignore[arg-type]


@pytest.mark.smollm
async def test_split_smollm_matches_single(smollm_ckpt: Path, engine_starter) -> None:
    from kascade_engine.tokenizer import load_tokenizer

    blocks = pack_checkpoint(smollm_ckpt, model="smollm2-135m")
    tok = load_tokenizer(smollm_ckpt)
    prompt = tok.encode("The capital of France is")
    params = SamplingParams(max_tokens=5)
    want = _single(blocks, prompt, params)
    assert "Paris" in tok.decode(want)
    a = engine_starter(["--smollm", "--model-name", "smollm2-135m"])
    try:
        got = await _split_with(a, _partial(blocks, 13), "s", prompt, params, 13)
    finally:
        a.stop()
    assert got == want


async def test_zigzag_holds_until_peer_idle_and_uses_new_layers(tiny_blocks) -> None:
    """B holds the prompt while A is busy, runs layers as they land, and hands over once A is idle."""
    import asyncio

    a = _partial(tiny_blocks, 4)
    a.add_block("head", tiny_blocks.blocks["head"].tensors())
    busy = {"v": True}
    finisher = Finisher(a, busy=lambda: busy["v"])
    listener = await TcpTransport().listen("127.0.0.1", 0, finisher.handle)
    conn = await TcpTransport().connect("127.0.0.1", listener.port)
    b = _partial(tiny_blocks, 1)
    prompt, params = [9, 8, 7, 6], SamplingParams(max_tokens=5)

    async def land() -> None:  # layers 1 and 2 arrive while A is busy; then A goes idle
        for i in (1, 2):
            await asyncio.sleep(0.05)
            b.add_block(f"layer.{i}", tiny_blocks.blocks[f"layer.{i}"].tensors())
        await asyncio.sleep(0.05)
        busy["v"] = False

    try:
        landing = asyncio.create_task(land())
        got = await SplitClient(b, conn).generate("z", prompt, params, 1, zigzag=True)
        await landing
    finally:
        await conn.close()
        await listener.close()
    assert got == _single(tiny_blocks, prompt, params)
    assert finisher.layers_finished == 1 * len(got)  # split at k=3 for every step: A ran only layer 3
