"""PNG charts of a results document (``dsv4-ort bench --plot``; needs matplotlib, the ``bench`` extra).

* ``roofline.png`` - every measured kernel as a point (arithmetic intensity, achieved GFLOP/s) under the roofs:
  DRAM bandwidth x intensity and the peak of each compute path, log-log; dsv4-ort points coloured by ISA level,
  baselines as hollow markers.
* ``tokens_vs_context.png`` - decode tokens/s against context for each batch size and implementation, with the
  bytes-per-token roofline of dsv4-ort dashed.
"""

from __future__ import annotations

from pathlib import Path

LEVEL_COLOURS = {"scalar": "#9e9e9e", "avx2": "#1f77b4", "avx512": "#2ca02c", "amx": "#d62728"}
BASELINE_MARKERS = {"torch_fp32": "s", "torch_bf16": "D", "ort_matmul_fp32": "^", "ort_matmulnbits_int4": "v",
                    "ort_matmulnbits_int4_acc0": "<", "hf_fp32": "P"}


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib: pip install 'dsv4-ort[bench]'") from e
    return plt


def roofline_chart(results: dict, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 6.5))
    m = results["machine"]
    bw = m["bandwidth"]["all_threads"]["best"]
    recs = [r for r in results.get("kernels", []) if isinstance(r.get("time"), dict) and r.get("bytes")
            and r.get("flops")]
    xs = [r["flops"] / r["bytes"] for r in recs] or [1.0]
    lo, hi = min(xs + [0.05]) / 2, max(xs + [200.0]) * 2
    import numpy as np

    grid = np.logspace(np.log10(lo), np.log10(hi), 200)
    ax.plot(grid, bw * grid, color="black", lw=1.2, label=f"DRAM {bw:.1f} GB/s")
    for name, p in m.get("peaks", {}).items():
        if name.startswith("int8"):
            continue
        ax.plot(grid, np.minimum(bw * grid, p["best"]), lw=0.8, ls="--", label=f"{name} {p['best']:.0f} GFLOP/s")
    seen = set()
    for r in recs:
        x, y = r["flops"] / r["bytes"], r["gflops"]
        if r["impl"] == "dsv4-ort":
            lvl = r.get("level", "scalar")
            lab = f"dsv4-ort [{lvl}]"
            ax.scatter(x, y, s=22, color=LEVEL_COLOURS.get(lvl, "#444"), label=None if lab in seen else lab,
                       zorder=3, marker="o" if r["phase"] == "decode" else "*")
        else:
            lab = r["impl"]
            ax.scatter(x, y, s=26, facecolors="none", edgecolors="#555", marker=BASELINE_MARKERS.get(r["impl"], "x"),
                       label=None if lab in seen else lab, zorder=2)
        seen.add(lab)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / compulsory byte)")
    ax.set_ylabel("achieved GFLOP/s")
    c = results["conditions"]
    ax.set_title(f"Roofline: {c['cpu']['model']}, {c['threads']} threads ({results['mode']}); o decode, * prefill")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7, loc="lower right", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def context_chart(results: dict, path: Path) -> Path | None:
    runs = [r for r in results.get("e2e", {}).get("runs", [])
            if r.get("kind") == "decode" and isinstance(r.get("time"), dict)]
    if not runs:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5))
    series = {}
    for r in runs:
        series.setdefault((r["impl"], r["batch"], r.get("isa_cap")), []).append((r["context"], r["tokens_per_s"]))
    for (impl, B, cap), pts in sorted(series.items(), key=lambda kv: str(kv[0])):
        pts.sort()
        label = f"{impl}" + (f" [{cap}]" if cap else "") + f", batch {B}"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    acc = results.get("e2e", {}).get("accounting", [])
    for B in sorted({a["batch"] for a in acc}):
        pts = sorted((a["context"], a["roofline_tokens_per_s"]) for a in acc if a["batch"] == B
                     and a.get("roofline_tokens_per_s"))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ls="--", color="black", alpha=0.6,
                    label=f"roofline (bytes/token), batch {B}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (positions in the state)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("Decode speed vs context")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def write_all(results: dict, out_dir) -> list:
    out = Path(out_dir)
    paths = [roofline_chart(results, out / "roofline.png"), context_chart(results, out / "tokens_vs_context.png")]
    return [p for p in paths if p is not None]


__all__ = ["write_all", "roofline_chart", "context_chart"]
