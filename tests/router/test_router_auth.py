"""Client authentication (issue 38, the router as a front door): API keys from a file, each allowed every
model or a list; no or a wrong key 401, a model the key may not use 403, /v1/models lists the key's models,
a rotated file is picked up without a restart, a bad file stops the router from starting (naming the line)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kascade_devcluster.stubengine import StubEngine
from kascade_router.auth import parse
from kascade_router.server import Router, static_routes
from kascade_router.settings import RouterSettings

KEYS = "# clients\nsk-all-models-0001\nsk-only-m-000002 m\n"


@pytest.fixture
async def router(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    made: list[Any] = []

    async def make(text: str = KEYS) -> tuple[Router, Path]:
        f = tmp_path / "keys"
        f.write_text(text)
        engines = [await StubEngine(name=n).start() for n in ("m", "other")]
        r = await Router(RouterSettings(api_keys_file=str(f), hold_timeout_s=1.0),
                         static_routes([f"{e.name}={e.address}" for e in engines])).start()
        made.extend([r, *engines])
        return r, f

    yield make
    for x in made:
        await x.close()


async def call(port: int, model: str, key: str | None) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{port}/v1/completions",
                                                    json={"model": model, "prompt": "x"}, headers=headers) as r:
        return r.status, await r.json(content_type=None)


async def test_keys_and_model_allow_lists(router: Callable[..., Any]) -> None:
    r, _ = await router()
    st, body = await call(r.port, "m", None)
    assert st == 401 and "API key" in body["error"]["message"]
    assert (await call(r.port, "m", "sk-wrong-key-000"))[0] == 401
    assert (await call(r.port, "m", "sk-all-models-0001"))[0] == 200
    assert (await call(r.port, "other", "sk-all-models-0001"))[0] == 200
    assert (await call(r.port, "m", "sk-only-m-000002"))[0] == 200
    st, body = await call(r.port, "other", "sk-only-m-000002")
    assert st == 403 and "'other'" in body["error"]["message"]
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{r.port}/v1/models") as resp:
            assert resp.status == 401
        async with s.get(f"http://127.0.0.1:{r.port}/v1/models",
                         headers={"Authorization": "Bearer sk-only-m-000002"}) as resp:
            assert [m["id"] for m in (await resp.json())["data"]] == ["m"]


async def test_a_rotated_key_file_is_picked_up(router: Callable[..., Any]) -> None:
    r, f = await router()
    f.write_text("sk-new-key-00003 other\n")
    st = os.stat(f)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a new mtime even on a coarse clock
    await asyncio.sleep(1.1)
    assert (await call(r.port, "other", "sk-new-key-00003"))[0] == 200
    assert (await call(r.port, "m", "sk-all-models-0001"))[0] == 401


def test_bad_key_files_name_the_line() -> None:
    with pytest.raises(ValueError, match="keys:2: an API key must be at least 8"):
        parse("sk-fine-key-0001\nshort\n", "keys")
    with pytest.raises(ValueError, match="keys:2: a key listed twice"):
        parse("sk-fine-key-0001\nsk-fine-key-0001 m\n", "keys")
    with pytest.raises(ValueError, match="no API keys"):
        parse("# none\n", "keys")
    with pytest.raises(ValueError, match="keys:1: expected"):
        parse("a b c\n", "keys")


def test_the_cli_refuses_a_bad_key_file_naming_the_flag(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from kascade_cli.router import router as router_cmd

    bad = tmp_path / "keys"
    bad.write_text("short\n")
    res = CliRunner().invoke(router_cmd, ["--backend", "m=127.0.0.1:1", "--api-keys-file", str(bad)])
    assert res.exit_code == 2 and "--api-keys-file" in res.output and "keys:1" in res.output
    res = CliRunner().invoke(router_cmd, ["--help"])
    for flag in ("--admin-port", "--api-keys-file", "--header-timeout", "--body-timeout", "--max-connections",
                 "--first-byte-timeout", "--probe-timeout", "--eject-after-failures", "--max-backend-connections"):
        assert flag in res.output, flag
