"""Disaggregated serving over each data-plane transport an engine can be configured with (`--transport`):
P listens on its data port with its own transport (as `kascade engine serve` does: `EngineInstance.transport`)
and D fetches the KV with its own. Greedy output equals the colocated engine's, and the KV bytes are
counted by the transport that carried them (its `Traffic`), on both ends; UCX runs here over tcp/loopback.
An unknown transport is refused by name, before anything listens."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from splitref import collect, unsplit

from kascade_devcluster.requirement import need_transport
from kascade_engine.batch.sampling import SamplingParams
from kascade_engine.config import ConfigError, EngineConfig
from kascade_engine.instance import EngineInstance
from kascade_engine.net.transports import make_transport
from kascade_engine.tokenizer import ByteTokenizer

PROMPTS = [[11, 42, 7, 300, 5, 9, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [1, 2, 3], list(range(40, 77))]
TOKEN = "pd-transport-token"


def _instance(ckpt: Path, blocks: Any, name: str, transport: str, batch: int = 16) -> EngineInstance:
    cfg = EngineConfig(checkpoint=ckpt, model_name="tiny-llama", token=TOKEN, kv_tokens=2048,
                       max_batch_tokens=batch, instance=name, transport=transport)
    return EngineInstance(cfg, blocks.config, ByteTokenizer(), blocks)


@pytest.mark.parametrize("transport", ["tcp", "ucx"])
async def test_kv_moves_over_the_configured_transport_with_the_colocated_output(
        tiny_ckpt, tiny_blocks, transport: str) -> None:
    need_transport(transport)
    params = SamplingParams(max_tokens=8)
    want = unsplit(tiny_blocks, PROMPTS, params)
    p = _instance(tiny_ckpt, tiny_blocks, "p", transport)  # chunked on P: the long prompt takes several steps
    d = _instance(tiny_ckpt, tiny_blocks, "d", transport)
    assert p.transport.name == d.transport.name == transport
    p.serving.start()
    d.serving.start()
    listener = await p.transport.listen("127.0.0.1", 0, lambda c: p.finisher.handle(c))  # what the CLI listens with
    peer = f"127.0.0.1:{listener.port}"
    try:
        rids = [d.serving.submit(pr, params, prefill=peer) for pr in PROMPTS]
        got = await asyncio.wait_for(asyncio.gather(*(collect(d, r) for r in rids)), 120)
        assert got == want
        rp, ps = d.remote_prefill, p.prefill_server
        assert (rp.adopted, rp.fallbacks, ps.requests, ps.refused) == (len(PROMPTS), 0, len(PROMPTS), 0)
        s = d.model.shape
        kv = sum(len(pr) for pr in PROMPTS) * 2 * s.layers * s.kv_heads * s.head_dim * 4  # float32 K and V
        assert rp.bytes_received == ps.bytes_sent == kv
        # counted by the transports themselves, where the payloads met the wire: every KV byte went over
        # P's and D's `transport` (the hello's frames carry no payload, so nothing else is counted here)
        assert p.transport.traffic.sent == d.transport.traffic.received == kv
        assert rp.pool.transport is d.transport and rp.pool.handshakes <= len(PROMPTS)
    finally:
        await d.close()
        await p.close()
        await listener.close()


def test_an_unknown_transport_is_refused_naming_the_setting_and_the_value(tiny_ckpt) -> None:
    with pytest.raises(ConfigError, match=r"--transport 'quic': unknown transport; use tcp or ucx"):
        EngineConfig(checkpoint=tiny_ckpt, model_name="tiny-llama", token=TOKEN, transport="quic")
    with pytest.raises(ValueError, match=r"unknown transport 'rdma' \(choose tcp or ucx\)"):
        make_transport("rdma")
