"""A/B of two attnkit source trees (e.g. two git worktrees) on the kernel's hot cases.

    python benchmarks/ab_trees.py OLD_TREE NEW_TREE [--rounds 3] [--cases sliding,dense,...]

Each round runs one process per tree, alternating (OLD, NEW, OLD, NEW, ...), so a busy
moment of this shared machine hits both; each process imports attnkit from ``TREE/src``
(building that tree's native kernel into its own cache entry on first use), runs every
case ``--reps`` times interleaved with an sgemm yardstick (decode: a read-bandwidth
yardstick), and prints the medians. Compare the two trees' lines round by round.

Cases (float32, B=1, H=8, D=64 unless noted): ``sliding`` (window 512, N=8192, forward),
``dense`` / ``causal`` (N=4096, forward), ``decode`` (1 query over 32768 keys, D=128; also
a bfloat16 cache), ``alibi`` (causal N=4096 forward with ALiBi), ``sliding_bwd`` /
``causal_bwd`` (forward + backward: window 512 at N=8192, causal at N=2048; useful FLOPs
counted as 3.5× the forward's).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

CASES = ("sliding", "dense", "causal", "alibi", "decode", "sliding_bwd", "causal_bwd")


def one_process(cases: list[str], reps: int) -> None:
    """Run in the child: time each case, print one line."""
    import torch

    import attnkit as ak
    from attnkit.scores import alibi

    torch.manual_seed(0)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    x = torch.randn(2 * 8 * 32768 * 128)

    def qkv(n: int, d: int = 64, nq: int | None = None) -> list[torch.Tensor]:
        return [torch.randn(1, 8, nq or n, d), torch.randn(1, 8, n, d), torch.randn(1, 8, n, d)]

    runs: dict[str, tuple] = {}                    # name -> (fn, work, unit)
    for c in cases:
        if c == "sliding":
            q, k, v = qkv(8192)
            m = ak.masks.sliding_window(512)
            work = 4.0 * 8 * 64 * (1 - m.sparsity(8192, 8192)) * 8192**2
            runs[c] = (lambda q=q, k=k, v=v, m=m: ak.attention(q, k, v, mask=m), work, "flop")
        elif c in ("dense", "causal", "alibi"):
            q, k, v = qkv(4096)
            m = None if c == "dense" else ak.masks.causal()
            sm = alibi(8) if c == "alibi" else None
            pairs = 4096**2 if c == "dense" else 4096 * 4097 / 2
            runs[c] = (lambda q=q, k=k, v=v, m=m, sm=sm: ak.attention(q, k, v, mask=m,
                                                                       score_mod=sm),
                       4.0 * 8 * 64 * pairs, "flop")
        elif c in ("sliding_bwd", "causal_bwd"):
            n = 8192 if c == "sliding_bwd" else 2048
            q, k, v = (t.requires_grad_() for t in qkv(n))
            m = ak.masks.sliding_window(512) if c == "sliding_bwd" else ak.masks.causal()
            go = torch.randn(1, 8, n, 64)

            def fwd_bwd(q=q, k=k, v=v, m=m, go=go) -> None:
                with torch.enable_grad():
                    ak.attention(q, k, v, mask=m).backward(go)
            work = 3.5 * 4.0 * 8 * 64 * (1 - m.sparsity(n, n)) * n * n
            runs[c] = (fwd_bwd, work, "flop")
        elif c == "decode":
            q, k, v = qkv(32768, 128, nq=1)
            kb, vb, qb = k.bfloat16(), v.bfloat16(), q.bfloat16()
            runs[c] = (lambda q=q, k=k, v=v: ak.attention(q, k, v), k.numel() * 8.0, "byte")
            runs["decode_bf16"] = (lambda q=qb, k=kb, v=vb: ak.attention(q, k, v),
                                   k.numel() * 4.0, "byte")
    yard = {"flop": (lambda: a @ b, 2.0 * 2048**3), "byte": (lambda: x.sum(), x.numel() * 4.0)}
    times: dict[str, list[float]] = {n: [] for n in [*runs, *yard]}
    with torch.no_grad():
        for f, _, _ in runs.values():
            f()                                    # warm-up (and the first build)
        for _ in range(reps):
            for n, f in [*((n, r[0]) for n, r in runs.items()), *((n, y[0]) for n, y in
                                                                  yard.items())]:
                t0 = time.perf_counter()
                f()
                times[n].append(time.perf_counter() - t0)
    med = {n: statistics.median(t) for n, t in times.items()}
    rate = {u: yard[u][1] / med[u] for u in yard}
    parts = [f"sgemm {rate['flop'] / 1e9:.0f} GFLOP/s, read {rate['byte'] / 1e9:.1f} GB/s"]
    for n, (_, work, unit) in runs.items():
        of = "of sgemm" if unit == "flop" else "of read bw"
        parts.append(f"{n} {med[n] * 1e3:.1f} ms ({work / med[n] / rate[unit]:.2f} {of})")
    print(" | ".join(parts), flush=True)


def alternating(ap: argparse.ArgumentParser, trees: list[str], rounds: int, script: str,
                args: list[str]) -> Iterator[tuple[int, str, subprocess.CompletedProcess]]:
    """Check the trees (at least two, each with src/attnkit: else ``ap.error``), then run
    ``script args`` once per tree and round, alternating the trees, each importing attnkit
    from its own ``src``; yields (round, tree, the finished process). bench_hotpath uses it."""
    if len(trees) < 2:
        ap.error("give two source trees to compare (e.g. two git worktrees)")
    for tree in trees:
        if not os.path.isdir(os.path.join(tree, "src", "attnkit")):
            ap.error(f"{tree} has no src/attnkit")
    for r in range(rounds):
        for tree in trees:
            env = {**os.environ, "PYTHONPATH": os.path.join(os.path.abspath(tree), "src")}
            yield r + 1, tree, subprocess.run([sys.executable, os.path.abspath(script), *args],
                                              env=env, capture_output=True, text=True,
                                              check=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="*", help="two (or more) source trees, each with src/attnkit")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5, help="timed runs per case and process")
    ap.add_argument("--cases", default="sliding,dense,causal,decode",
                    help=f"comma-separated, from {', '.join(CASES)}")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    if args.child:
        one_process(cases, args.reps)
        return 0
    for r, tree, out in alternating(ap, args.trees, args.rounds, __file__,
                                    ["--child", "--reps", str(args.reps),
                                     "--cases", ",".join(cases)]):
        line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr
        print(f"round {r} {tree}: {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
