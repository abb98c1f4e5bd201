"""PNG plots of simulation results (matplotlib, Agg backend: no display needed).

Data flow: results of several systems on one workload -> one figure with request rate, TTFT over time,
TTFT and TBT CDFs and GPUs allocated over time, one line per system -> a PNG file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kascade_sim.result import Result


def plot(results: Sequence[Result], path: str | Path, bucket_s: float = 10.0) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(6, 1, figsize=(9, 19))
    first = results[0]
    n = int(max(first.arrival_s) // bucket_s) + 1
    rate = [0] * n
    for a in first.arrival_s:
        rate[int(a // bucket_s)] += 1
    ax[0].plot([i * bucket_s for i in range(n)], [c / bucket_s for c in rate], color="black")
    ax[0].set_ylabel("requests/s")
    ax[0].set_title(f"{first.workload}")
    for r in results:
        sums = [0.0] * n
        cnt = [0] * n
        for a, t in zip(r.arrival_s, r.ttft_s, strict=True):
            sums[int(a // bucket_s)] += t
            cnt[int(a // bucket_s)] += 1
        ax[1].plot([i * bucket_s for i in range(n) if cnt[i]], [sums[i] / cnt[i] for i in range(n) if cnt[i]],
                   label=r.system)
        bsum = [0.0] * n
        bcnt = [0] * n
        for a, b in zip(r.arrival_s, r.tbt_s, strict=True):
            if b == b:
                bsum[int(a // bucket_s)] += b
                bcnt[int(a // bucket_s)] += 1
        ax[5].plot([i * bucket_s for i in range(n) if bcnt[i]], [bsum[i] / bcnt[i] for i in range(n) if bcnt[i]],
                   label=r.system)
        tt = sorted(r.ttft_s)
        ax[2].plot(tt, [(i + 1) / len(tt) for i in range(len(tt))], label=r.system)
        tb = sorted(x for x in r.tbt_s if x == x)
        if tb:
            ax[3].plot(tb, [(i + 1) / len(tb) for i in range(len(tb))], label=r.system)
        ax[4].step([s[0] for s in r.samples], [s[1] for s in r.samples], where="post", label=r.system)
    ax[1].set_ylabel("mean TTFT (s)")
    ax[1].set_yscale("log")
    ax[2].set_xlabel("TTFT (s)")
    ax[2].set_xscale("log")
    ax[3].set_xlabel("TBT (s)")
    ax[3].set_xscale("log")
    ax[4].set_ylabel("GPUs allocated")
    ax[4].set_xlabel("time (s)")
    ax[5].set_ylabel("mean TBT (s)")
    ax[5].set_yscale("log")
    ax[5].set_xlabel("time of arrival (s)")
    for a in ax[1:]:
        a.legend(fontsize=7)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out
