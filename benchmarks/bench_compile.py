"""A compiled attention layer, forward + backward: attnkit inside vs torch SDPA inside.

    .venv/bin/python benchmarks/bench_compile.py            # B=2, N=1024, d=512, 8 heads
    .venv/bin/python benchmarks/bench_compile.py --n 2048

Both modules have the same weights (the SDPA one copies attnkit's projections) and are
compiled with ``torch.compile(fullgraph=True)``; attnkit appears in the graph as the custom
operator ``attnkit::attention``. Compile time is reported apart (first call); the timed
calls alternate between the two modules, and the ratio is SDPA's median time ÷ attnkit's.
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
    args = ap.parse_args()
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
    times: dict[str, list[float]] = {n: [] for n in mods}
    for _ in range(args.repeat):
        for name, f in compiled.items():
            x.grad = None
            t0 = time.perf_counter()
            f(x).backward(go)
            times[name].append(time.perf_counter() - t0)
    med = {n: statistics.median(t) for n, t in times.items()}
    print(f"compiled attention layer fwd+bwd — B={args.batch}, N={args.n}, "
          f"d_model={args.d_model}, heads {args.heads}/{args.kv_heads}, causal, float32, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in mods:
        print(f"  {name:8} median {med[name] * 1e3:8.1f} ms   first call (compile) "
              f"{first[name]:5.1f} s")
    print(f"  speedup (SDPA time / attnkit time, >1 = attnkit faster): "
          f"{med['sdpa'] / med['attnkit']:.2f}x   max |out difference| {diff:.1e}")


if __name__ == "__main__":
    main()
