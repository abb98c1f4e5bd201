"""Issue 38: any client of a decode engine could make it dial any host:port by naming it in `X-Kascade-Prefill`.
With --require-prefill-signature the engine dials only peers a router holding the engine token signed
(`X-Kascade-Prefill-Sig`); an unsigned or wrongly signed peer is a 403 and nothing is dialled. On a real engine
process, with a listening socket standing for the named host."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kascade_planner.engine_api import PREFILL_FALLBACK_HEADER, PREFILL_HEADER, PREFILL_SIG_HEADER, prefill_signature

MODEL, TOKEN = "tiny-llama", "sig-token"


class Trap:
    """A listener that counts the connections made to it and closes each at once (the engine falls back)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.dialled = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.dialled += 1
            conn.close()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def decoder(tiny_ckpt: Path, engine_starter: Any) -> Iterator[Any]:
    e = engine_starter(["--checkpoint", str(tiny_ckpt), "--model-name", MODEL, "--max-prompt-tokens", "64",
                        "--kv-tokens", "4096", "--require-prefill-signature"], token=TOKEN)
    yield e
    e.stop()


def _post(url: str, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                      headers=headers, timeout=60)


def test_an_unsigned_prefill_peer_is_refused_and_never_dialled(decoder: Any) -> None:
    trap = Trap()
    for headers in ({PREFILL_HEADER: trap.address},
                    {PREFILL_HEADER: trap.address, PREFILL_SIG_HEADER: prefill_signature("not-the-token",
                                                                                         trap.address, None)},
                    {PREFILL_FALLBACK_HEADER: trap.address},
                    # signed for another peer: the signature covers the address
                    {PREFILL_HEADER: trap.address, PREFILL_SIG_HEADER: prefill_signature(TOKEN, "10.0.0.1:1", None)}):
        r = _post(decoder.url, headers)
        assert r.status_code == 403, r.text
        err = r.json()["error"]
        assert err["type"] == "permission_error" and err["param"] in (PREFILL_HEADER.lower(),
                                                                      PREFILL_FALLBACK_HEADER.lower())
    assert trap.dialled == 0


def test_a_signed_prefill_peer_is_dialled(decoder: Any) -> None:
    trap = Trap()
    r = _post(decoder.url, {PREFILL_HEADER: trap.address,
                            PREFILL_SIG_HEADER: prefill_signature(TOKEN, trap.address, None)})
    assert r.status_code == 200, r.text  # the peer closed: prefilled here instead
    assert trap.dialled >= 1
    assert _post(decoder.url, {}).status_code == 200  # no peer named: nothing to sign
