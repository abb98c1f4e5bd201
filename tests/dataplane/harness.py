"""Test harness: a tiny random Llama checkpoint, plans over loopback, and real transfer processes."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kascade_devcluster.ports import free_ports
from kascade_engine.net.transfer_spec import TransferSpec
from kascade_engine.weights.blocks import BlockSet, pack_checkpoint
from kascade_engine.weights.hostcache import write_cache
from kascade_planner.plan import Plan


def tiny_checkpoint(path: Path, layers: int = 6, hidden: int = 64, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=hidden * 4, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


@dataclass
class Cluster:
    spec: TransferSpec
    workdir: Path
    cache: Path
    transport: str = "tcp"
    procs: dict[str, subprocess.Popen[str]] = field(default_factory=dict)

    target_linger: float = 3.0
    tls: dict[str, Path] | None = None  # {"cert", "key", "ca"}: every participant runs mutual TLS

    def start(self, me: str, start_when: Path | None = None) -> subprocess.Popen[str]:
        spec_file = self.workdir / "spec.json"
        spec_file.write_text(json.dumps(self.spec.to_dict()))
        args = [sys.executable, "-m", "kascade_cli.main", "transfer", "run", "--spec", str(spec_file), "--me", me,
                "--transport", self.transport]
        if start_when is not None:
            args += ["--start-when", str(start_when)]
        if self.tls:
            args += [
                "--tls-cert",
                str(self.tls["cert"]),
                "--tls-key",
                str(self.tls["key"]),
                "--tls-ca",
                str(self.tls["ca"]),
            ]
        if any(s.id == me for s in self.spec.plan.sources):
            args += ["--cache", str(self.cache), "--linger", "30"]
        else:
            args += ["--out", str(self.workdir / f"{me}.kcache"), "--linger", str(self.target_linger)]
        env = {**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"}
        with open(self.workdir / f"{me}.log", "w") as log:  # the child keeps its own copy of the fd
            p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, text=True, env=env, start_new_session=True)
        self.procs[me] = p
        return p

    def start_all(self, listen_timeout: float = 180) -> None:
        """Start every participant and begin the plan once all listen. Processes come up seconds apart on a
        loaded machine (a 5 s spread at load 12): started free, a target's watchdog could fire before its
        source had even imported, and a test of a mid-transfer fault would count that re-fetch too."""
        go = self.workdir / "start-plan"
        go.unlink(missing_ok=True)
        ids = [i.id for i in (*self.spec.plan.sources, *self.spec.plan.targets)]
        for me in ids:
            self.start(me, start_when=go)
        deadline = time.monotonic() + listen_timeout
        for me in ids:  # one that exited before listening is the test's to report (wait() shows its log)
            while '"listening"' not in self.log(me) and self.procs[me].poll() is None:
                if time.monotonic() > deadline:
                    raise AssertionError(f"{me} not listening after {listen_timeout} s: {self.log(me)[-2000:]}")
                time.sleep(0.02)
        go.touch()

    def wait(self, me: str, timeout: float = 60) -> dict[str, object]:
        p = self.procs[me]
        out, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0, f"{me} exited {p.returncode}: {(self.workdir / f'{me}.log').read_text()[-2000:]}"
        return json.loads(out.strip().splitlines()[-1])

    def signal(self, me: str, sig: int) -> None:
        os.killpg(self.procs[me].pid, sig)

    def kill(self, me: str) -> None:
        os.killpg(self.procs[me].pid, signal.SIGKILL)
        self.procs[me].wait()

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def log(self, me: str) -> str:
        return (self.workdir / f"{me}.log").read_text()


def make_cluster(workdir: Path, blocks: BlockSet, plan: Plan, transport: str = "tcp", chunk: int = 64 << 10,
                 faults: dict[str, dict[str, object]] | None = None, timeout_s: float = 5.0) -> Cluster:
    ids = [i.id for i in (*plan.sources, *plan.targets)]
    ports = free_ports(len(ids))
    spec = TransferSpec(plan, blocks.manifest(), {i: ("127.0.0.1", p) for i, p in zip(ids, ports, strict=True)},
                        secrets.token_hex(8), chunk, timeout_s, faults or {})
    cache = workdir / "source.kcache"
    if not cache.exists():
        write_cache(cache, blocks)
    return Cluster(spec, workdir, cache, transport)


def packed(path: Path) -> BlockSet:
    return pack_checkpoint(path)


def wait_for(cond: object, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise TimeoutError("condition not met")
