"""Paged decode step vs contiguous caches vs "gather pages, then SDPA" (issue 23's targets).

One decode step of a batch of sequences of different lengths: each appends one new token
(k, v written in place at its length) and attends over its keys, causal. Variants, timed
interleaved within each round (machine noise hits them alike), medians over ``--repeats``:

    paged        ak.attention_with_kvcache(q, k_pages, v_pages, k, v, cache_seqlens=,
                 block_table=, causal=True)             pages in random pool order, read
                 through the block table in the native kernel
    paged-gather the same call on attnkit's fallback path (each sequence's pages gathered
                 into a contiguous copy, then attended): what runs without the kernel
    contiguous   the same call on contiguous (B, N_max, H_kv, D) caches
    gather+SDPA  write the new tokens into the pages, gather every sequence's pages into a
                 padded (B, H_kv, N_max, D) copy, torch SDPA with a padding mask (enable_gqa)

and the read-bandwidth yardstick, timed in the same rounds: ``sum`` over a 256 MB float32
tensor (far beyond the caches). "of read bw" = the K and V bytes each variant must read
(every sequence's keys once, in the cache's dtype; GQA heads share them) per second ÷ the
yardstick's bytes per second.

a mixed batch — 2 prefill chunks of ``--chunk`` over their own cache plus decodes — as
one ak.attention_varlen call on the paged pool vs one torch SDPA call per sequence on
gathered keys; and ``--batch`` forks of a ``--prefix``-token prompt with ``--own`` tokens
each: one decode step with the prefix attended once (cascade, ``shared_prefix=True``) vs
per sequence (``shared_prefix=False``). Last, the peak memory of one paged decode step
beyond the pool and the output: the growth of the peak resident set over the
step, in a fresh child process whose inputs are built and whose kernel is loaded and warmed
on a small call first (RSS sees the kernel's C++ buffers, which torch's allocator stats
would not).

    .venv/bin/python benchmarks/bench_paged.py            # 16 sequences of 512–8192 keys
    .venv/bin/python benchmarks/bench_paged.py --quick    # a smoke run
    .venv/bin/python benchmarks/bench_paged.py --only cascade   # one case: decode, mixed,
                                                                # cascade or memory
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

import attnkit as ak
import attnkit.serving as serving


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown CPU"


def median_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {n: [] for n in fns}
    for fn in fns.values():                       # warm-up (native kernel load, caches)
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {n: statistics.median(t) for n, t in times.items()}


def build(lengths: list[int], block_size: int, h_kv: int, d: int, dtype: torch.dtype
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pools with every sequence's pages (room for one more token) in random pool order."""
    need = [-(-(n + 1) // block_size) for n in lengths]
    n_blocks = sum(need)
    k_pages = torch.randn(n_blocks, block_size, h_kv, d).to(dtype)
    v_pages = torch.randn(n_blocks, block_size, h_kv, d).to(dtype)
    perm = torch.randperm(n_blocks).to(torch.int32)
    table = torch.full((len(lengths), max(need)), -1, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at: at + n]
        at += n
    return k_pages, v_pages, table


def gather_padded(pool: torch.Tensor, table: torch.Tensor, n_max: int) -> torch.Tensor:
    """(num_blocks, bs, H, D) pages → (B, H, n_max, D), every row's pages gathered."""
    idx = table.clamp_min(0).long()                                        # (B, P)
    g = pool[idx].flatten(1, 2)[:, :n_max]                                 # (B, n_max, H, D)
    return g.transpose(1, 2)


@contextlib.contextmanager
def gather_fallback() -> Iterator[None]:
    """attnkit's paged calls on their fallback path (pages gathered, then attended), as
    without the native kernel."""
    real = serving._use_native
    serving._use_native = lambda *a, **k: False  # type: ignore[assignment]
    try:
        yield
    finally:
        serving._use_native = real


def fallback(fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        with gather_fallback():
            return fn()
    return run


def status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak_rss() -> int:
    """Reset the peak RSS (VmHWM) to the current RSS (Linux: ``5`` into clear_refs) → the
    current RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_kb("VmRSS") * 1024


def rss_child(kind: str, args: argparse.Namespace) -> None:
    """One paged decode step (the benchmark's first case) in this fresh process; prints the
    growth of the peak RSS over the step in bytes."""
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    B, H, H_kv, D, bs = args.batch, args.heads, args.kv_heads, args.head_dim, args.block_size
    lengths = torch.randint(args.min_len, args.max_len + 1, (B,)).tolist()
    k_pages, v_pages, table = build(lengths, bs, H_kv, D, dtype)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    q = torch.randn(B, 1, H, D).to(dtype)
    k_new, v_new = torch.randn(B, 1, H_kv, D).to(dtype), torch.randn(B, 1, H_kv, D).to(dtype)
    kw = dict(cache_seqlens=seqlens, block_table=table, causal=True)
    ctx = gather_fallback() if kind == "gather" else contextlib.nullcontext()
    with ctx:                                     # warm: kernel loaded, code paths run once
        small = table[:, :2].contiguous()
        ak.attention_with_kvcache(q, k_pages, v_pages, k_new, v_new,
                                  cache_seqlens=torch.full((B,), bs), block_table=small,
                                  causal=True)
        before = reset_peak_rss()
        out = ak.attention_with_kvcache(q, k_pages, v_pages, k_new, v_new, **kw)
        after = status_kb("VmHWM") * 1024
    del out
    print(after - before)


def peak_rss_step(kind: str) -> int:
    """:func:`rss_child` in a fresh process (the same options) → bytes."""
    cmd = [sys.executable, __file__, "--rss-child", kind, *sys.argv[1:]]
    return int(subprocess.run(cmd, capture_output=True, text=True, check=True)
               .stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=512)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--own", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="8 sequences of 256–2048, 3 repeats")
    ap.add_argument("--only", choices=["decode", "mixed", "cascade", "memory"],
                    help="run one case only (for A/B runs of the old tree against a new one)")
    ap.add_argument("--rss-child", choices=["paged", "gather"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.batch, args.min_len, args.max_len, args.repeats = 8, 256, 2048, 3
        args.prefix, args.chunk = 1024, 256
    if args.rss_child:
        return rss_child(args.rss_child, args)
    torch.manual_seed(0)
    B, H, H_kv, D, bs = args.batch, args.heads, args.kv_heads, args.head_dim, args.block_size
    lengths = torch.randint(args.min_len, args.max_len + 1, (B,)).tolist()
    print(f"CPU: {cpu_name()}  ({torch.get_num_threads()} threads, torch {torch.__version__})")
    only = args.only
    print(f"decode step: {B} sequences of {min(lengths)}–{max(lengths)} keys, GQA {H}/{H_kv}, "
          f"D={D}, {args.dtype} cache, block_size {bs}")

    if only in (None, "decode"):
        decode_case(args, lengths)
    if only in (None, "mixed"):
        mixed_case(args, lengths)
    if only in (None, "cascade"):
        cascade_case(args)
    if only in (None, "memory"):
        memory_case()


def decode_case(args: argparse.Namespace, lengths: list[int]) -> None:
    """Paged decode vs contiguous caches vs gather+SDPA."""
    dtype = getattr(torch, args.dtype)
    B, H, H_kv, D, bs = args.batch, args.heads, args.kv_heads, args.head_dim, args.block_size
    n_max = max(lengths) + 1
    k_pages, v_pages, table = build(lengths, bs, H_kv, D, dtype)
    k_cont = torch.randn(B, n_max, H_kv, D).to(dtype)
    v_cont = torch.randn(B, n_max, H_kv, D).to(dtype)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    q = torch.randn(B, 1, H, D).to(dtype)
    k_new = torch.randn(B, 1, H_kv, D).to(dtype)
    v_new = torch.randn(B, 1, H_kv, D).to(dtype)
    valid = torch.arange(n_max)[None, :] < (seqlens + 1)[:, None]            # (B, n_max)

    def paged() -> object:
        return ak.attention_with_kvcache(q, k_pages, v_pages, k_new, v_new,
                                         cache_seqlens=seqlens, block_table=table, causal=True)

    def contiguous() -> object:
        return ak.attention_with_kvcache(q, k_cont, v_cont, k_new, v_new,
                                         cache_seqlens=seqlens, causal=True)

    def gather_sdpa() -> object:
        pos = seqlens.long()
        page = table.long().gather(1, (pos // bs)[:, None])[:, 0]
        k_pages[page, pos % bs] = k_new[:, 0]
        v_pages[page, pos % bs] = v_new[:, 0]
        kg, vg = gather_padded(k_pages, table, n_max), gather_padded(v_pages, table, n_max)
        return F.scaled_dot_product_attention(q.transpose(1, 2), kg, vg,
                                              attn_mask=valid[:, None, None, :],
                                              enable_gqa=True).transpose(1, 2)

    got = paged()
    want = gather_sdpa()
    err = (got.float() - want.float()).abs().max().item()
    x_read = torch.ones(256 * 2**20 // 4)                  # the read-bandwidth yardstick
    ms = median_ms({"paged": paged, "paged-gather": fallback(paged), "contiguous": contiguous,
                    "gather+SDPA": gather_sdpa, "_read": x_read.sum}, args.repeats)
    bw = x_read.numel() * 4 / ms.pop("_read") / 1e6        # GB/s
    kv_bytes = 2 * sum(n + 1 for n in lengths) * H_kv * D * k_pages.element_size()
    print(f"  (paged vs gather+SDPA max |diff| {err:.2e}; K+V {kv_bytes / 1e6:.0f} MB; read "
          f"bandwidth (sum of 256 MB, same rounds) {bw:.1f} GB/s)")
    print(f"{'variant':<14}{'median ms':>11}{'GB/s (K+V read)':>17}{'of read bw':>12}"
          f"{'paged speed-up':>16}")
    for name, t in ms.items():
        gb_s = kv_bytes / t / 1e6
        print(f"{name:<14}{t:>11.2f}{gb_s:>17.1f}{gb_s / bw:>12.2f}{t / ms['paged']:>15.2f}x")
    print(f"paged vs contiguous: {ms['contiguous'] / ms['paged']:.2f}x (target >= 0.9x); "
          f"paged vs gather+SDPA: {ms['gather+SDPA'] / ms['paged']:.2f}x (target >= 2x); "
          f"paged vs paged-gather: {ms['paged-gather'] / ms['paged']:.2f}x; paged "
          f"{kv_bytes / ms['paged'] / 1e6 / bw:.2f} of read bandwidth (target >= 0.8)")



def mixed_case(args: argparse.Namespace, lengths: list[int]) -> None:
    """A mixed batch: 2 prefill chunks (own cache of len) + decodes, one varlen call."""
    dtype = getattr(torch, args.dtype)
    B, H, H_kv, D, bs = args.batch, args.heads, args.kv_heads, args.head_dim, args.block_size
    n_pre = min(2, B)
    len_q = [args.chunk] * n_pre + [1] * (B - n_pre)
    len_k = [n + lq for n, lq in zip(lengths, len_q, strict=True)]
    kp, vp, tb = build([n - 1 for n in len_k], bs, H_kv, D, dtype)
    cu_q = torch.tensor([0, *torch.tensor(len_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(len_k).cumsum(0).tolist()], dtype=torch.int32)
    qv = torch.randn(int(cu_q[-1]), H, D).to(dtype)

    def varlen() -> object:
        return ak.attention_varlen(qv, kp, vp, cu_q, cu_k, block_table=tb, causal=True)

    def per_seq_sdpa() -> object:
        outs = []
        for b in range(B):
            n = len_k[b]
            idx = tb[b, : -(-n // bs)].long()
            kb = kp[idx].flatten(0, 1)[:n].transpose(0, 1)[None]
            vb = vp[idx].flatten(0, 1)[:n].transpose(0, 1)[None]
            qb = qv[int(cu_q[b]): int(cu_q[b + 1])].transpose(0, 1)[None]
            lq = len_q[b]
            m = (torch.arange(n)[None, :] <= torch.arange(lq)[:, None] + n - lq)
            outs.append(F.scaled_dot_product_attention(qb, kb, vb, attn_mask=m,
                                                       enable_gqa=True)[0].transpose(0, 1))
        return torch.cat(outs)

    err = (varlen().float() - per_seq_sdpa().float()).abs().max().item()
    ms = median_ms({"varlen": varlen, "varlen-gather": fallback(varlen),
                    "per-seq SDPA": per_seq_sdpa}, args.repeats)
    print(f"\nmixed batch: {n_pre} prefill chunks of {args.chunk} + {B - n_pre} decodes "
          f"(max |diff| {err:.2e})")
    for name, t in ms.items():
        print(f"{name:<14}{t:>11.2f} ms")
    print(f"varlen vs one SDPA per sequence: {ms['per-seq SDPA'] / ms['varlen']:.2f}x "
          "(target >= 1.5x)")



def cascade_case(args: argparse.Namespace) -> None:
    """Shared prefix: B forks of one prompt, own tokens each, one decode step."""
    dtype = getattr(torch, args.dtype)
    B, H, H_kv, D, bs = args.batch, args.heads, args.kv_heads, args.head_dim, args.block_size
    q = torch.randn(B, 1, H, D).to(dtype)
    k_new = torch.randn(B, 1, H_kv, D).to(dtype)
    v_new = torch.randn(B, 1, H_kv, D).to(dtype)
    prefix, own = args.prefix, args.own
    cache = ak.PagedKVCache(-(-prefix // bs) + B * (-(-(own + 1) // bs) + 1), bs, H_kv, D,
                            dtype=dtype)
    root = cache.new_sequence()
    cache.append(root, torch.randn(prefix, H_kv, D).to(dtype),
                 torch.randn(prefix, H_kv, D).to(dtype))
    seqs = []
    for _ in range(B):
        s = cache.fork(root)
        cache.append(s, torch.randn(own, H_kv, D).to(dtype), torch.randn(own, H_kv, D).to(dtype))
        seqs.append(s)
    cache.reserve(seqs, 1)
    lens, tab = cache.seqlens(seqs), cache.block_table(seqs)

    def step(shared: bool) -> object:
        return ak.attention_with_kvcache(q, cache.k_pages, cache.v_pages, k_new, v_new,
                                         cache_seqlens=lens, block_table=tab, causal=True,
                                         shared_prefix=shared)

    err = (step(True).float() - step(False).float()).abs().max().item()
    ms = median_ms({"prefix once": lambda: step(True), "per sequence": lambda: step(False),
                    "once, gather": fallback(lambda: step(True))}, args.repeats)
    print(f"\nshared prefix: {B} sequences sharing a {prefix}-token prefix, {own} own tokens "
          f"each, decode step (max |diff| {err:.2e})")
    for name, t in ms.items():
        print(f"{name:<14}{t:>11.2f} ms")
    print(f"prefix once (cascade) vs per sequence: "
          f"{ms['per sequence'] / ms['prefix once']:.2f}x (target >= 3x)")



def memory_case() -> None:
    """Peak memory of a paged decode step beyond the pool and the output."""
    paged_b, gather_b = peak_rss_step("paged"), peak_rss_step("gather")
    print(f"\npeak memory of one paged decode step beyond the pool and the output (peak RSS "
          f"growth, fresh process): in-kernel {paged_b / 2**20:.1f} MB (target <= 16 MB), "
          f"gather fallback {gather_b / 2**20:.1f} MB")


if __name__ == "__main__":
    main()
