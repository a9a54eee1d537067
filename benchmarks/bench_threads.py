"""Two-thread efficiency of the native kernel against torch SDPA: one thread over H heads
and two threads over 2H heads, alternating in one process (so a drift of the machine hits
both), medians. Efficiency = one-thread time ÷ two-thread time (1.0 = the second core
doubles the work done). Prints the CPU (lscpu's model name, torch's capability).

    .venv/bin/python benchmarks/bench_threads.py [--dtype bfloat16] [--causal] [--heads 4]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import attnkit as ak
from attnkit.bench import cpu_description


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--heads", type=int, default=4, help="heads on one thread (twice on two)")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=11)
    args = ap.parse_args()
    if args.heads < 1 or args.n < 1 or args.reps < 1:
        ap.error("--heads, --n and --reps must be at least 1")
    dt = getattr(torch, args.dtype)
    h = args.heads
    q2, k2, v2 = (torch.randn(1, 2 * h, args.n, 64).to(dt) for _ in range(3))
    q1, k1, v1 = (t[:, :h].contiguous() for t in (q2, k2, v2))
    fs: dict[str, Callable[..., torch.Tensor]] = {
        "attnkit": ak.scaled_dot_product_attention, "SDPA": F.scaled_dot_product_attention}

    def run(f: Callable[..., torch.Tensor], threads: int, q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor) -> float:
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        f(q, k, v, is_causal=args.causal)
        return time.perf_counter() - t0

    times: dict[tuple[str, int], list[float]] = {(n, t): [] for n in fs for t in (1, 2)}
    print(cpu_description())
    with torch.no_grad():
        for f in fs.values():
            run(f, 1, q1, k1, v1)
            run(f, 2, q2, k2, v2)
        for _ in range(args.reps):
            for name, f in fs.items():
                times[(name, 1)].append(run(f, 1, q1, k1, v1))
                times[(name, 2)].append(run(f, 2, q2, k2, v2))
    for name in fs:
        one, two = (statistics.median(times[(name, t)]) for t in (1, 2))
        print(f"{name:8s} {args.dtype} {'causal' if args.causal else 'dense'} N={args.n}: "
              f"1 thread {h} heads {one * 1e3:6.1f} ms | 2 threads {2 * h} heads "
              f"{two * 1e3:6.1f} ms | two-thread efficiency {one / two:.2f}")


if __name__ == "__main__":
    main()
