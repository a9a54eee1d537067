"""``attnkit bench``'s outputs besides the table: the JSON records, the PNG chart, and the
spread measure the noise verdict uses (see :mod:`attnkit.bench`)."""

from __future__ import annotations

import json
import math
import statistics
from typing import Any

from ._outfiles import savefig_kwargs

__all__ = ["spread", "write_json", "plot"]


def spread(xs: list[float]) -> float:
    """Half the 10–90 % range (the full range below 10 samples), in % of the median."""
    xs = sorted(xs)
    if len(xs) < 2:
        return 0.0
    lo, hi = (xs[0], xs[-1]) if len(xs) < 10 else (
        xs[int(0.1 * (len(xs) - 1))], xs[math.ceil(0.9 * (len(xs) - 1))])
    return 50.0 * (hi - lo) / statistics.median(xs)


def write_json(path: str, meta: dict[str, object], cases: list[Any]) -> None:
    """One flat record per (case, implementation), each carrying the run's metadata."""
    rows = []
    for c in cases:
        if "records" not in c.results:
            rows.append({"case": c.name, "impl": None, "error": c.results.get("error"),
                         **{k: meta[k] for k in ("date", "torch", "threads")}})
            continue
        yard = {"sgemm_flops": c.results["flops_s"],
                "read_bw": c.results["bw"] if "read_samples" in c.results else None,
                "case_spread_pct": round(max(spread(c.results.get(k, []))  # type: ignore
                                             for k in ("sgemm_samples", "lowp_gemm_samples",
                                                       "read_samples")), 2)}
        for r in c.results["records"]:  # type: ignore[union-attr]
            rows.append({**r, "yardsticks": yard, "date": meta["date"], "torch": meta["torch"],
                         "threads": meta["threads"],
                         "noise_pct": meta["noise"]["pct"]})  # type: ignore[index]
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
        f.write("\n")


def plot(path: str, cases: list[Any], meta: dict[str, object]) -> None:
    """A horizontal bar chart: per case, attnkit's speedup against each peer (log scale, the
    bars grow from 1 — right of the line attnkit is faster)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, NullFormatter

    short = {"sdpa": "torch SDPA", "flex": "FlexAttention (compiled)", "naive": "naive formula",
             "baseline": "the same call without the option"}
    data = [(c.name, {r["impl"]: r["ratio"] for r in c.results.get("records", [])  # type: ignore
                      if r["impl"] in short and r["ratio"]}) for c in cases]
    data = [(n, v) for n, v in data if v]
    used = [p for p in short if any(p in v for _, v in data)]
    fig = Figure(figsize=(9, 1.6 + 0.25 * max(1, len(data)) * max(1, len(used))),
                 layout="constrained")
    ax = fig.subplots()
    h = 0.8 / max(1, len(used))
    for j, p in enumerate(used):
        pts = [(i + (j - (len(used) - 1) / 2) * h, v[p]) for i, (_, v) in enumerate(data)
               if p in v]
        ax.barh([y for y, _ in pts], [x - 1 for _, x in pts], left=1, height=h,
                label=f"vs {short[p]}", color=f"C{list(short).index(p)}")
        for y, x in pts:
            ax.annotate(f"{x:.2f}×", (x, y), fontsize=7, va="center",
                        ha="left" if x >= 1 else "right", xytext=(3 if x >= 1 else -3, 0),
                        textcoords="offset points")
    ax.axvline(1.0, color="black", lw=1)
    ax.set_xscale("log")
    xs = [x for _, v in data for x in v.values()] + [1.0]
    lo, hi = min(xs) / 2, max(xs) * 2
    ax.set_xlim(lo, hi)
    ax.set_xticks([m * 10.0**e for e in range(-3, 4) for m in (1, 2, 5) if lo <= m * 10.0**e <= hi])
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}×"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_yticks(range(len(data)), [n for n, _ in data])
    ax.invert_yaxis()
    ax.set_xlabel("speedup = peer time / attnkit time  (>1 = attnkit faster; log scale)")
    ax.set_title(f"attnkit bench {meta['date']}, torch {meta['torch']}, {meta['threads']} "
                 f"threads\n{meta['noise']['verdict'].split(' (')[0]}",  # type: ignore[index]
                 fontsize=9)
    if used:
        fig.legend(fontsize=8, loc="outside lower center", ncols=len(used))
    fig.savefig(path, dpi=110, **savefig_kwargs(path))
