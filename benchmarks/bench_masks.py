"""Dense bool tensor masks on CPU: ``ak.scaled_dot_product_attention`` against torch SDPA given
the same ``attn_mask`` (issue 20, item 4: a bool mask at the kernel's speed).

Masks, each (B, 1, N, N) bool as a transformers model passes them: ``random`` (30% of keys
blocked at random: every tile partial), ``pad+causal`` (a left-aligned causal mask with
per-row padding lengths 512 / 400 / 300 / 200: empty, full and partial tiles). Also the
unmasked call, for what the mask itself costs. The two calls alternate ``--reps`` times in one
process, per ``--rounds``; the lines give medians (ms) and ratios (SDPA time ÷ attnkit time:
> 1 means attnkit is faster), with the CPU named.

    .venv/bin/python benchmarks/bench_masks.py [--shape 4,8,512,64] [--reps 15] [--rounds 3]
        [--dtype float32|bfloat16] [--backward]
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


def masks(b: int, n: int) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([512, 400, 300, 200]).repeat((b + 3) // 4)[:b] * n // 512
    pad = (torch.arange(n) < lens[:, None])[:, None, None, :]              # (B, 1, 1, N)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return {"none": None,
            "random": torch.rand(b, 1, n, n, generator=g) > 0.3,
            "pad+causal": (pad & causal).expand(b, 1, n, n).contiguous()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="4,8,512,64")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--backward", action="store_true")
    args = ap.parse_args()
    b, h, n, d = (int(x) for x in args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    print(f"CPU: {cpu_description()}; torch {torch.__version__}, capability "
          f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads; "
          f"shape {(b, h, n, d)} {args.dtype}{' fwd+bwd' if args.backward else ' fwd'}")
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, h, n, d, generator=g).to(dtype).requires_grad_(args.backward)
               for _ in range(3))
    go = torch.randn(b, h, n, d, generator=g).to(dtype)

    def call(f: Callable[..., torch.Tensor], m: torch.Tensor | None) -> Callable[[], None]:
        def run() -> None:
            out = f(q, k, v, attn_mask=m)
            if args.backward:
                out.backward(go)
        return run

    cases = masks(b, n)
    for m in cases.values():                        # warm up every call (threads, allocator)
        for f in (ak.scaled_dot_product_attention, F.scaled_dot_product_attention):
            for _ in range(3):
                call(f, m)()
    for name, m in cases.items():
        ratios, ta, ts = [], [], []
        for _ in range(args.rounds):
            fa = call(ak.scaled_dot_product_attention, m)
            fs = call(F.scaled_dot_product_attention, m)
            fa()
            fs()
            xa, xs = [], []
            for _ in range(args.reps):
                for f, xs_ in ((fa, xa), (fs, xs)):
                    t0 = time.perf_counter()
                    f()
                    xs_.append(time.perf_counter() - t0)
            a, s = statistics.median(xa), statistics.median(xs)
            ta.append(a * 1e3)
            ts.append(s * 1e3)
            ratios.append(s / a)
        print(f"  {name:<11} attnkit {statistics.median(ta):7.2f} ms   SDPA "
              f"{statistics.median(ts):7.2f} ms   ratio per round "
              + " / ".join(f"{r:.2f}×" for r in ratios))


if __name__ == "__main__":
    main()
