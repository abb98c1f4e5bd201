"""The PD benchmark's presentation (bench/pd.py): its result (pd.json's dict) as a table on stdout and as a
bar chart of SLO attainment per setup, real engines beside the simulator on the same trace."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(out: dict[str, Any], modes: list[str], path: Path) -> Path:
    """TTFT and TBT SLO attainment per setup, real engines beside the simulator, as one bar chart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    eng = out.get("engines") or {}
    real = (f"real engines, EMULATED accelerator ({eng['layer_ms']:g} ms/layer)" if eng.get("emulated")
            else "real engines (CPU)")
    for ax, (title, block) in zip(axes, ((real, out), ("simulator, same trace", out["sim"])), strict=True):
        for j, (key, label) in enumerate((("ttft_slo_attainment", "TTFT"), ("tbt_slo_attainment", "TBT"),
                                          ("burst_ttft_slo_attainment", "TTFT, burst prompts"))):
            ax.bar([i + 0.27 * (j - 1) for i in range(len(modes))], [block[m][key] for m in modes], 0.27, label=label)
        ax.set_xticks(range(len(modes)), [m.replace("_", "\n") for m in modes])
        ax.set_title(title)
        ax.set_ylim(0, 1.05)
    axes[0].set_ylabel("SLO attainment")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(out: dict[str, Any], modes: list[str], requests: int) -> None:
    """The attainment table: real engines, then the simulator on the same trace."""
    print(
        f"{requests} requests ({out['trace']['burst_requests']} in the burst), 2 engines per setup; {out['slo_note']}"
    )
    eng = out.get("engines") or {}
    if eng.get("emulated"):
        print(f"ENGINES EMULATED: {eng['compute']}")
    for title, block in (
        ("real engines" + (" (EMULATED accelerator)" if eng.get("emulated") else ""), out),
        (
            f"simulator (trace time-compressed x{out['sim']['time_compression']:.1f}, "
            f"SLOs TTFT {out['sim']['ttft_slo_ms']:.0f} ms, TBT "
            f"{out['sim']['tbt_slo_ms']:.1f} ms)",
            out["sim"],
        ),
    ):
        print(f"{title}:")
        print("  setup                      TTFT att.  TBT att.  burst TTFT  TTFT p50/p99 ms    TBT p50/p99 ms  fail")
        for mode in modes:
            r = block[mode]
            print(f"  {mode:26} {r['ttft_slo_attainment']:9.2f} {r['tbt_slo_attainment']:9.2f} "
                  f"{r['burst_ttft_slo_attainment']:11.2f}  {r['ttft_p50_s'] * 1e3:7.0f}/{r['ttft_p99_s'] * 1e3:7.0f}  "
                  f"{r['tbt_p50_s'] * 1e3:7.1f}/{r['tbt_p99_s'] * 1e3:7.1f}  {r['failures']:4d}")
    for mode in modes:
        r = out[mode]
        if r.get("decoder_local_prefills") is not None:
            print(f"  {mode}: decoder prefilled {r['decoder_local_prefills']} prompt(s) itself, handed back "
                  f"{r['decoder_handbacks']:.0f}; conversions at {r.get('conversions_at')}; while converted "
                  f"{r.get('converted_digest')}")
        for k, f in (r.get("emulation_floor") or {}).items():  # how well the emulated floor held
            print(f"  {mode} {k}: {f['steps']} steps, mean {f['mean_ms']} ms vs floor {f['floor_ms']} ms, "
                  f"{f.get('over_share', float('nan')):.1%} over {f.get('over_ms', float('nan')):g} ms")
