"""A prefill engine P and a decode engine D in this process, for the disaggregated-serving tests (test_disagg,
test_handback): P serves its data port (the same Finisher.handle the CLI listens with, plain TCP, token hello)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kascade_engine.config import EngineConfig
from kascade_engine.instance import EngineInstance
from kascade_engine.net.transport_tcp import TcpTransport
from kascade_engine.tokenizer import ByteTokenizer

PROMPTS = [[11, 42, 7, 300, 5, 9, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [1, 2, 3],
           [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 17], [100], list(range(40, 77))]
TOKEN = "pd-token"


def instance(ckpt: Path, blocks: Any, name: str, batch: int = 64, token: str = TOKEN,
             layer_ms: float = 0.0) -> EngineInstance:
    cfg = EngineConfig(checkpoint=ckpt, model_name="tiny-llama", token=token, kv_tokens=2048,
                       max_batch_tokens=batch, instance=name, emulate_layer_ms=layer_ms)
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


async def pd_pair(ckpt: Path, blocks: Any, p_batch: int = 64, d_token: str = TOKEN, p_layer_ms: float = 0.0) -> PD:
    p = instance(ckpt, blocks, "p", batch=p_batch, layer_ms=p_layer_ms)
    d = instance(ckpt, blocks, "d", token=d_token)
    p.serving.start()
    d.serving.start()
    listener = await TcpTransport().listen("127.0.0.1", 0, lambda c: p.finisher.handle(c))
    return PD(p, d, listener)
