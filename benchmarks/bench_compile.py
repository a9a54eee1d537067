"""A compiled attention layer, forward + backward: attnkit inside vs torch SDPA inside.

    .venv/bin/python benchmarks/bench_compile.py            # B=2, N=1024, d=512, 8 heads
    .venv/bin/python benchmarks/bench_compile.py --batch 4 --n 512 --d-model 256  # issue 20
    .venv/bin/python benchmarks/bench_compile.py --n 2048

Both modules have the same weights (the SDPA one copies attnkit's projections) and are
compiled with ``torch.compile(fullgraph=True)``; attnkit appears in the graph as the custom
operator ``attnkit::attention``, whose backward reuses the forward's saved output and LSE
(the native kernel's own backward on CPU). Compile time is reported apart (first call);
each round times one forward + backward of every module in turn (compiled attnkit,
compiled SDPA, then both eager, for reference), and the ratios are SDPA's median time ÷
attnkit's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import attnkit as ak


class SdpaAttention(nn.Module):
    """The same layer as ``ak.MultiHeadAttention`` (no bias, causal), calling torch SDPA."""

    def __init__(self, ref: ak.MultiHeadAttention) -> None:
        super().__init__()
        self.h, self.h_kv = ref.n_heads, ref.n_kv_heads
        self.q_proj, self.k_proj = ref.q_proj, ref.k_proj
        self.v_proj, self.out_proj = ref.v_proj, ref.out_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.h, -1).transpose(1, 2)      # (B, H, N, D)
        k = self.k_proj(x).view(b, n, self.h_kv, -1).transpose(1, 2)   # (B, H_kv, N, D)
        v = self.v_proj(x).view(b, n, self.h_kv, -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.h != self.h_kv)
        return self.out_proj(o.transpose(1, 2).reshape(b, n, -1))    # (B, N, d)


class AttnkitAttention(nn.Module):
    def __init__(self, layer: ak.MultiHeadAttention) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x, is_causal=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layer = ak.MultiHeadAttention(args.d_model, args.heads, n_kv_heads=args.kv_heads)
    mods = {"attnkit": AttnkitAttention(layer), "sdpa": SdpaAttention(layer)}
    x = torch.randn(args.batch, args.n, args.d_model, requires_grad=True)
    go = torch.randn(args.batch, args.n, args.d_model)
    compiled, first = {}, {}
    for name, m in mods.items():
        compiled[name] = torch.compile(m, fullgraph=True)
        t0 = time.perf_counter()
        compiled[name](x).backward(go)
        first[name] = time.perf_counter() - t0
    with torch.no_grad():
        diff = (compiled["attnkit"](x) - compiled["sdpa"](x)).abs().max().item()
    runs = {**{f"compiled {n}": f for n, f in compiled.items()},
            **{f"eager {n}": m for n, m in mods.items()}}
    for f in runs.values():                                    # warm the eager paths too
        f(x).backward(go)
    times: dict[str, list[float]] = {n: [] for n in runs}
    for _ in range(args.repeat):
        for name, f in runs.items():
            x.grad = None
            t0 = time.perf_counter()
            f(x).backward(go)
            times[name].append(time.perf_counter() - t0)
    med = {n: statistics.median(t) for n, t in times.items()}
    print(f"attention layer fwd+bwd — B={args.batch}, N={args.n}, "
          f"d_model={args.d_model}, heads {args.heads}/{args.kv_heads}, causal, float32, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"median of {args.repeat} alternating rounds")
    for name in runs:
        kind, lib = name.split()
        extra = f"   first call (compile) {first[lib]:5.1f} s" if kind == "compiled" else ""
        print(f"  {name:16} median {med[name] * 1e3:8.1f} ms{extra}")
    for kind in ("compiled", "eager"):
        per_round = statistics.median(
            s / a for s, a in zip(times[f"{kind} sdpa"], times[f"{kind} attnkit"], strict=True))
        print(f"  {kind} speedup (SDPA time / attnkit time, >1 = attnkit faster): "
              f"{med[f'{kind} sdpa'] / med[f'{kind} attnkit']:.2f}x of the medians, "
              f"{per_round:.2f}x median of the rounds' ratios")
    print(f"  max |out difference| (compiled) {diff:.1e}")


if __name__ == "__main__":
    main()
