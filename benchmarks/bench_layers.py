"""Decode speed and KV-cache size of MHA vs GQA vs MLA layers of the same d_model.

Each layer is prefilled with a ``--context``-token prompt (chunked, through its KVCache),
then decodes ``--steps`` tokens one at a time with ``is_causal=True``. Reported per variant:
median decode tokens/s over ``--repeats`` rounds (variants interleaved within each round so
machine noise hits them alike), the ratio to MHA, the cache bytes at the context length, and
the cost model's prediction of those bytes.

    .venv/bin/python benchmarks/bench_layers.py            # 4k context, d_model 1024
    .venv/bin/python benchmarks/bench_layers.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shlex
import statistics
import sys
import time

import torch

import attnkit as ak
from attnkit.api import prepare
from attnkit.backends import select


def build(args: argparse.Namespace) -> dict[str, torch.nn.Module]:
    d, H = args.d_model, args.heads
    return {
        "MHA": ak.MultiHeadAttention(d, H),
        f"GQA (H_kv={args.kv_heads})": ak.MultiHeadAttention(d, H, n_kv_heads=args.kv_heads),
        f"MLA (d_c={args.kv_latent}, absorbed)": ak.MultiHeadLatentAttention(
            d, H, kv_latent_dim=args.kv_latent),
        f"MLA (d_c={args.kv_latent}, plain)": ak.MultiHeadLatentAttention(
            d, H, kv_latent_dim=args.kv_latent),
    }


def prefill(layer: torch.nn.Module, prompt: torch.Tensor, max_len: int, chunk: int
            ) -> ak.KVCache:
    cache = ak.KVCache(max_len=max_len)
    for i in range(0, prompt.shape[1], chunk):
        layer(prompt[:, i:i + chunk], cache=cache, is_causal=True)
    return cache


def decode_tokens_per_s(layer: torch.nn.Module, cache: ak.KVCache, tokens: torch.Tensor,
                        absorb: bool | None) -> float:
    """Decode tokens one at a time from a copy of the prefilled cache; tokens/s."""
    length = cache.length
    kw = {} if absorb is None else {"absorb": absorb}
    t0 = time.perf_counter()
    for i in range(tokens.shape[1]):
        layer(tokens[:, i:i + 1], cache=cache, is_causal=True, **kw)
    dt = time.perf_counter() - t0
    cache.truncate(length)            # roll the cache back for the next round
    return tokens.shape[1] / dt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--kv-latent", type=int, default=256)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk length")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.context, args.steps, args.repeats, args.d_model = 256, 8, 2, 256
        args.kv_latent = 64
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = torch.float32

    layers = build(args)
    prompt = torch.randn(1, args.context, args.d_model, dtype=dtype)
    tokens = torch.randn(1, args.steps, args.d_model, dtype=dtype)
    max_len = args.context + args.steps
    caches, cache_bytes = {}, {}
    with torch.no_grad():
        for name, layer in layers.items():
            layer.eval()
            caches[name] = prefill(layer, prompt, max_len, args.chunk)
            cache_bytes[name] = caches[name].nbytes
        rates: dict[str, list[float]] = {n: [] for n in layers}
        for _ in range(args.repeats + 1):                  # first round = warm-up
            for name, layer in layers.items():
                absorb = None if "MLA" not in name else "absorbed" in name
                rates[name].append(decode_tokens_per_s(layer, caches[name], tokens, absorb))
    # which backend "auto" picks for one MHA decode step (one query sees the whole cache)
    h, dh = args.heads, args.d_model // args.heads
    probe = prepare(torch.randn(1, h, 1, dh), torch.randn(1, h, args.context, dh),
                    torch.randn(1, h, args.context, dh)).problem
    backend = select(probe).name
    model = ak.cost.report(args.d_model, args.heads, args.context, n_kv_heads=args.kv_heads,
                           kv_latent_dim=args.kv_latent, dtype_bytes=4)

    cmd = " ".join(shlex.quote(a) for a in [".venv/bin/python", "benchmarks/bench_layers.py",
                                            *(argv if argv is not None else sys.argv[1:])])
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"command: {cmd}")
    print(f"date: {now}; torch {torch.__version__}, {args.threads} threads, "
          f"{platform.machine()}; decode backend (auto): {backend}")
    print(f"d_model={args.d_model}, heads={args.heads}, context={args.context}, batch 1, "
          f"float32; {args.steps} decode steps × {args.repeats} rounds (+1 warm-up), median")
    print()
    print("| layer | decode tokens/s | vs MHA | cache bytes @ context | model (cost.report) |")
    print("|---|---:|---:|---:|---:|")
    mha = statistics.median(rates["MHA"][1:])
    for name in layers:
        r = statistics.median(rates[name][1:])
        key = name.split(" ")[0]
        print(f"| {name} | {r:,.0f} | {r / mha:.2f}× | {cache_bytes[name]:,} | "
              f"{model.kv_bytes[key]:,} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
