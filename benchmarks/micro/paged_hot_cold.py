"""The paged decode's compute time alone vs with its DRAM reads, one thread, thread CPU time.

bench_paged's decode shape (16 sequences of 1016–7005 keys, GQA 32/8, D=128, bf16 pages of
16 slots) through ``native.paged_attention``: "cold" with every sequence's pages distinct in
random pool order (~262 MB of K/V); "aliased to P pages" with the same block table taken
mod P, so the very same loops read a pool small enough to stay in cache.

    PYTHONPATH=src .venv/bin/python benchmarks/micro/paged_hot_cold.py

Xeon of 2026-12-04 (shared host): cold 432 ns per key (8 K/V heads; 417 with paged.h's
prefetch 16 ahead), aliased to 16 pages 207 ns per key; one core's plain read of 4 KB takes
~280-330 ns (page_reads.cpp).
"""

from __future__ import annotations

import statistics
import time

import torch

from attnkit.backends import native

H, H_KV, D, BS, DTYPE = 32, 8, 128, 16, torch.bfloat16


def build() -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lengths, K / V pools (num_blocks, BS, H_KV, D) and the block table (pages shuffled)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1016, 7006, (16,), generator=g).tolist()
    need = [-(-n // BS) for n in lengths]
    n_blocks = sum(need)
    k = torch.randn(n_blocks, BS, H_KV, D).to(DTYPE)
    v = torch.randn(n_blocks, BS, H_KV, D).to(DTYPE)
    perm = torch.randperm(n_blocks)
    table = torch.full((len(lengths), max(need)), -1, dtype=torch.int64)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at: at + n]
        at += n
    return lengths, k, v, table


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    lengths, k, v, table = build()
    q = torch.randn(len(lengths), H, D).to(DTYPE)
    cu = torch.arange(len(lengths) + 1)
    kl = torch.tensor(lengths)
    keys = sum(lengths)
    nbytes = keys * H_KV * D * 2 * k.element_size()

    def cpu_time(tab: torch.Tensor, reps: int = 9) -> float:
        native.paged_attention(q, k, v, tab, cu, kl)
        times = []
        for _ in range(reps):
            t0 = time.thread_time()
            native.paged_attention(q, k, v, tab, cu, kl)
            times.append(time.thread_time() - t0)
        return statistics.median(times)

    for pages in (None, 16, 64, 256):
        tab = table if pages is None else torch.where(table >= 0, table % pages, table)
        t = statistics.median(cpu_time(tab) for _ in range(3))
        name = "cold (distinct pages)" if pages is None else f"aliased to {pages} pages"
        print(f"{name:26s} {t * 1e3:6.2f} ms  {t / keys * 1e9:5.0f} ns/key  "
              f"{nbytes / t / 1e9:5.2f} GB/s (K+V bytes / time)")


if __name__ == "__main__":
    main()
