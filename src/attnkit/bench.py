"""``attnkit bench``: the CPU engine side by side with its peers, in one run.

For every case the same inputs go to:

- **attnkit** — ``attnkit.attention(..., backend="auto")`` (the ``tiled``/``decode`` engines);
- **sdpa** — torch's ``scaled_dot_product_attention`` (its default CPU kernel); for a
  structured mask it is given the equivalent dense bool mask (``is_causal`` for causal);
- **flex** — ``torch.nn.attention.flex_attention`` compiled with ``torch.compile``
  (forward only; compile time reported apart; when it cannot compile, the reason is shown);
- **naive** — the materialised formula ``softmax(QKᵀ·scale + M) V`` (skipped when its
  N_q × N_k scores would not fit comfortably).

Columns: median time of several runs; ``speedup`` = peer time ÷ attnkit time (> 1: attnkit
is faster); ``eff`` = useful FLOPs ÷ time ÷ the sgemm FLOP/s measured in this same run
(decode: bytes of K and V read ÷ time ÷ the read bandwidth measured in this run); ``peak MB``
= peak resident memory during the call beyond what was resident before it (RSS sampled
every 0.5 ms; large allocations are returned to the OS at once, so it tracks live memory).

Shape legend: B batch, H heads, N sequence length, D head width; every case is float32.

Caution
-------
- The machine may be shared: compare ratios measured in one run, not times across runs.
- Peak memory comes from RSS sampling: a spike shorter than 0.5 ms can be missed.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import math
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

__all__ = ["run_cli", "Case", "run_case", "measure"]


# ---------------------------------------------------------------------------- measuring
def _limit_malloc_caching() -> None:
    """Make glibc return big blocks to the OS at once, so RSS follows live memory."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 16)          # M_MMAP_THRESHOLD = 64 KiB (fixed, not adaptive)
    except OSError:
        pass


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakRSS:
    """Context manager: peak RSS above the level at entry (bytes), sampled in a thread."""

    def __enter__(self) -> _PeakRSS:
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._poll, daemon=True)
        self._t.start()
        return self

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.0005)

    def __exit__(self, *exc: object) -> None:
        self.peak = max(self.peak, _rss())
        self._stop.set()
        self._t.join()

    @property
    def extra_mb(self) -> float:
        return (self.peak - self.base) / 2**20


@dataclass
class Timing:
    median_s: float
    peak_mb: float
    runs: int


def measure(fn: Callable[[], object], repeat: int, warmup: int = 1) -> Timing:
    """Median wall time of ``repeat`` runs after ``warmup``; peak extra RSS of the first run."""
    for _ in range(warmup):
        fn()
    times = []
    peak = 0.0
    for i in range(repeat):
        if i == 0:
            with _PeakRSS() as pk:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            peak = pk.extra_mb
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return Timing(statistics.median(times), peak, repeat)


def sgemm_flops(n: int = 2048, repeat: int = 5) -> float:
    """float32 matmul FLOP/s of this machine, now (median of ``repeat``)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    t = measure(lambda: a @ b, repeat).median_s
    return 2 * n**3 / t


def read_bandwidth(mb: int = 512, repeat: int = 5) -> float:
    """Memory read bandwidth in bytes/s (``sum`` over a tensor much larger than the cache)."""
    x = torch.ones(mb * 2**20 // 4)
    t = measure(lambda: x.sum(), repeat).median_s
    return x.numel() * 4 / t


# ---------------------------------------------------------------------------- peers
def _naive(q, k, v, allowed=None, scale=None):  # noqa: ANN001, ANN202
    """The materialised formula (float32, O(N²) memory)."""
    s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    return torch.softmax(s, -1) @ v


def _flex_fn() -> tuple[Callable | None, str]:
    """(compiled flex_attention, "") or (None, why it is unavailable)."""
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except Exception as e:  # noqa: BLE001
        return None, f"flex_attention not importable: {type(e).__name__}: {e}"
    try:
        return torch.compile(flex_attention, dynamic=False), ""
    except Exception as e:  # noqa: BLE001
        return None, f"torch.compile failed: {type(e).__name__}: {e}"


# ---------------------------------------------------------------------------- cases
@dataclass
class Case:
    """One benchmark row group: shapes, mask, options and which peers to run."""

    name: str
    n_q: int
    n_k: int
    d: int = 64
    heads: int = 8
    batch: int = 1
    mask: str = "none"            # none | causal | sliding:W | document:S | causal_br
    backward: bool = False
    softcap: float | None = None
    score_mod: str | None = None  # alibi
    peers: tuple[str, ...] = ("sdpa", "flex", "naive")
    repeat: int = 3
    baseline: str | None = None   # compare with attnkit on this other case name instead
    results: dict[str, object] = field(default_factory=dict)


def _mask_objects(c: Case) -> tuple[object, Callable | None, torch.Tensor | None, bool]:
    """→ (attnkit mask, flex mask_mod, dense bool mask or None, sdpa is_causal)."""
    import attnkit as ak

    n_q, n_k = c.n_q, c.n_k
    kind, _, arg = c.mask.partition(":")
    if kind == "none":
        return None, None, None, False
    qi = torch.arange(n_q).view(-1, 1)
    ki = torch.arange(n_k).view(1, -1)
    if kind == "causal":
        return ak.masks.causal(), (lambda b, h, q, kv: q >= kv), None, True
    if kind == "causal_br":
        off = n_k - n_q
        dense = (qi + off) >= ki
        return ak.masks.causal(align="bottom_right"), (lambda b, h, q, kv: q + off >= kv), \
            dense, False
    if kind == "sliding":
        w = int(arg)
        dense = ((qi - ki) >= 0) & ((qi - ki) < w)
        return ak.masks.sliding_window(w), \
            (lambda b, h, q, kv: (q - kv >= 0) & (q - kv < w)), dense, False
    if kind == "document":
        size = int(arg)
        ids = torch.arange(n_q) // size
        dense = ids.view(-1, 1) == ids.view(1, -1)
        return ak.masks.document(ids), (lambda b, h, q, kv: ids[q] == ids[kv]), dense, False
    raise ValueError(f"unknown mask kind {c.mask!r}")


def _useful_pairs(c: Case, mask: object) -> float:
    if mask is None:
        return float(c.n_q * c.n_k)
    return (1.0 - mask.sparsity(c.n_q, c.n_k)) * c.n_q * c.n_k  # type: ignore[union-attr]


def run_case(c: Case, bw: float, flex: tuple[Callable | None, str],
             naive_limit_gb: float) -> list[tuple[str, str]]:
    """Run one case; returns printable (label, line) rows and fills ``c.results``.

    The sgemm yardstick (and, for decode, the read bandwidth) is measured inside the case,
    interleaved with the implementations; ``bw`` is used only when the case has no read
    yardstick of its own."""
    import attnkit as ak

    torch.manual_seed(0)
    B, H, d = c.batch, c.heads, c.d
    q = torch.randn(B, H, c.n_q, d)
    k = torch.randn(B, H, c.n_k, d)
    v = torch.randn(B, H, c.n_k, d)
    mask, mask_mod, dense, sdpa_causal = _mask_objects(c)
    score_mod = ak.scores.alibi(H) if c.score_mod == "alibi" else None
    pairs = _useful_pairs(c, mask)
    fwd_flops = 4.0 * B * H * pairs * d
    flops = fwd_flops * (3.5 if c.backward else 1.0)
    rows: list[tuple[str, str]] = []
    if c.backward:
        q.requires_grad_(True)
        k.requires_grad_(True)
        v.requires_grad_(True)
    go = torch.randn(B, H, c.n_q, d)

    def step(f: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            if c.backward:
                q.grad = k.grad = v.grad = None
                f().backward(go)
            else:
                with torch.no_grad():
                    f()
        return run

    impls: dict[str, Callable[[], None]] = {}
    impls["attnkit"] = step(lambda: ak.attention(q, k, v, mask=mask, softcap=c.softcap,
                                                 score_mod=score_mod))
    skipped: dict[str, str] = {}
    if "sdpa" in c.peers:
        if c.softcap is not None or score_mod is not None:
            skipped["sdpa"] = "no softcap/score_mod in torch SDPA"
        else:
            impls["sdpa"] = step(lambda: F.scaled_dot_product_attention(
                q, k, v, attn_mask=dense, is_causal=sdpa_causal))
    if "naive" in c.peers:
        gb = B * H * c.n_q * c.n_k * 4 * 3 / 2**30
        if gb > naive_limit_gb:
            skipped["naive"] = f"would materialise ~{gb:.1f} GB of scores"
        elif c.softcap is not None or score_mod is not None:
            skipped["naive"] = "not set up for softcap/score_mod"
        else:
            allowed = dense if dense is not None else (
                torch.ones(c.n_q, c.n_k, dtype=torch.bool).tril_() if sdpa_causal else None)
            impls["naive"] = step(lambda: _naive(q, k, v, allowed))
    compile_s = None
    if "flex" in c.peers:
        fn, why = flex
        if c.backward:
            skipped["flex"] = "forward only in this benchmark"
        elif fn is None:
            skipped["flex"] = why
        elif c.softcap is not None or score_mod is not None:
            skipped["flex"] = "not set up for softcap/score_mod"
        else:
            try:
                from torch.nn.attention.flex_attention import create_block_mask
                bm = (create_block_mask(mask_mod, None, None, c.n_q, c.n_k, device="cpu")
                      if mask_mod is not None else None)
                t0 = time.perf_counter()
                with torch.no_grad():
                    fn(q, k, v, block_mask=bm)
                compile_s = time.perf_counter() - t0
                impls["flex"] = step(lambda: fn(q, k, v, block_mask=bm))
            except Exception as e:  # noqa: BLE001
                msg = f"{type(e).__name__}: {e}".splitlines()[0][:160]
                skipped["flex"] = f"compile/run failed: {msg}"
    timings: dict[str, Timing] = {}
    # the yardsticks run interleaved with the implementations, so they see the same machine
    ga, gb = torch.randn(2048, 2048), torch.randn(2048, 2048)
    impls["_sgemm"] = lambda: ga @ gb
    if c.name.startswith("decode"):
        xr = torch.ones(64 * 2**20)                          # 256 MB, far beyond the caches
        impls["_read"] = lambda: xr.sum()
    # interleave the implementations run by run, so a busy moment hits all of them
    for fn_ in impls.values():
        fn_()                                              # warm-up
    per: dict[str, list[float]] = {n: [] for n in impls}
    peaks: dict[str, float] = {}
    for r in range(c.repeat):
        for name, fn_ in impls.items():
            if r == 0:
                with _PeakRSS() as pk:
                    t0 = time.perf_counter()
                    fn_()
                    per[name].append(time.perf_counter() - t0)
                peaks[name] = pk.extra_mb
            else:
                t0 = time.perf_counter()
                fn_()
                per[name].append(time.perf_counter() - t0)
    for name in impls:
        timings[name] = Timing(statistics.median(per[name]), peaks[name], c.repeat)
    flops_s = 2 * 2048**3 / timings.pop("_sgemm").median_s
    if "_read" in timings:
        bw = 64 * 2**20 * 4 / timings.pop("_read").median_s
    c.results["timings"] = timings
    c.results["skipped"] = skipped
    c.results["compile_s"] = compile_s
    c.results["flops_s"] = flops_s
    c.results["bw"] = bw
    ta = timings["attnkit"].median_s
    for name in ("attnkit", *[p for p in ("sdpa", "flex", "naive") if p in c.peers]):
        if name in timings:
            t = timings[name]
            ratio = t.median_s / ta
            if c.name.startswith("decode"):
                eff = 2 * B * H * c.n_k * d * 4 / t.median_s / bw
                eff_s = f"{eff:5.2f} bw"
            else:
                eff_s = f"{flops / t.median_s / flops_s:5.2f}"
            extra = f"  (compile {compile_s:.1f} s)" if name == "flex" and compile_s else ""
            rows.append((name, f"{t.median_s * 1e3:10.1f} {ratio:8.2f}x {eff_s:>9} "
                               f"{t.peak_mb:9.0f}{extra}"))
        elif name in skipped:
            rows.append((name, f"{'—':>10} {'':>9} {'':>9} {'':>9}  skipped: {skipped[name]}"))
    rows.append(("", f"(yardsticks in this case: sgemm {flops_s / 1e9:.1f} GFLOP/s"
                     + (f", read {bw / 1e9:.1f} GB/s)" if c.name.startswith("decode") else ")")))
    return rows


def _cases(quick: bool) -> list[Case]:
    """The target rows of the CPU-engine issue; ``quick`` shrinks N to finish in < 1 min."""
    if quick:
        return [
            Case("dense fwd N=1024", 1024, 1024),
            Case("causal fwd N=1024", 1024, 1024, mask="causal"),
            Case("sliding 256 fwd N=2048", 2048, 2048, mask="sliding:256"),
            Case("document 8x256 fwd N=2048", 2048, 2048, mask="document:256"),
            Case("causal fwd+bwd N=1024", 1024, 1024, mask="causal", backward=True,
                 peers=("sdpa", "naive")),
            Case("sliding 256 fwd+bwd N=2048", 2048, 2048, mask="sliding:256", backward=True,
                 peers=("sdpa",)),
            Case("decode 1x8192 D=128", 1, 8192, d=128, peers=("sdpa", "naive")),
            Case("ref: causal fwd+bwd N=1024", 1024, 1024, mask="causal", backward=True,
                 peers=()),
            Case("softcap fwd+bwd N=1024", 1024, 1024, mask="causal", backward=True,
                 softcap=30.0, peers=(), baseline="ref: causal fwd+bwd N=1024"),
            Case("alibi fwd+bwd N=1024", 1024, 1024, mask="causal", backward=True,
                 score_mod="alibi", peers=(), baseline="ref: causal fwd+bwd N=1024"),
        ]
    return [
        Case("dense fwd N=4096", 4096, 4096, repeat=5),
        Case("causal fwd N=4096", 4096, 4096, mask="causal", repeat=5),
        Case("sliding 512 fwd N=8192", 8192, 8192, mask="sliding:512"),
        Case("document 16x512 fwd N=8192", 8192, 8192, mask="document:512"),
        Case("causal fwd+bwd N=2048", 2048, 2048, mask="causal", backward=True, repeat=5,
             peers=("sdpa", "naive")),
        Case("sliding 512 fwd+bwd N=8192", 8192, 8192, mask="sliding:512", backward=True,
             peers=("sdpa",)),
        Case("decode 1x32768 D=128", 1, 32768, d=128, repeat=9, peers=("sdpa", "naive")),
        Case("causal fwd N=32768", 32768, 32768, mask="causal", repeat=1, peers=()),
        Case("ref: causal fwd+bwd N=4096", 4096, 4096, mask="causal", backward=True,
             peers=()),
        Case("softcap fwd+bwd N=4096", 4096, 4096, mask="causal", backward=True,
             softcap=30.0, peers=(), baseline="ref: causal fwd+bwd N=4096"),
        Case("alibi fwd+bwd N=4096", 4096, 4096, mask="causal", backward=True,
             score_mod="alibi", peers=(), baseline="ref: causal fwd+bwd N=4096"),
    ]


# (case name prefix, peer, minimum speedup, what) — the issue's targets; "eff" rows compare
# the efficiency column instead; "mem" the attnkit peak memory (MB, maximum).
_TARGETS = [
    ("dense fwd", "sdpa", 0.95, "≥ 0.95× torch SDPA"),
    ("dense fwd", "eff", 0.85, "≥ 0.85 of sgemm throughput"),
    ("causal fwd N=1024", "sdpa", 1.15, "≥ 1.15× torch SDPA"),
    ("causal fwd N=4096", "sdpa", 1.15, "≥ 1.15× torch SDPA"),
    ("sliding 256 fwd N", "sdpa", 20.0, "≥ 20× SDPA + dense bool mask"),
    ("sliding 512 fwd N", "sdpa", 20.0, "≥ 20× SDPA + dense bool mask"),
    ("sliding 256 fwd N", "flex", 2.0, "≥ 2× compiled FlexAttention"),
    ("sliding 512 fwd N", "flex", 2.0, "≥ 2× compiled FlexAttention"),
    ("document", "sdpa", 10.0, "≥ 10× SDPA + dense bool mask"),
    ("causal fwd+bwd N=1024", "sdpa", 1.1, "≥ 1.1× torch SDPA"),
    ("causal fwd+bwd N=2048", "sdpa", 1.1, "≥ 1.1× torch SDPA"),
    ("sliding 256 fwd+bwd", "sdpa", 10.0, "≥ 10× SDPA + dense bool mask"),
    ("sliding 512 fwd+bwd", "sdpa", 10.0, "≥ 10× SDPA + dense bool mask"),
    ("decode", "sdpa", 1.5, "≥ 1.5× torch SDPA"),
    ("decode", "eff", 0.7, "≥ 0.7 of read bandwidth"),
    ("causal fwd N=32768", "mem", 128.0, "peak beyond inputs+output ≤ 128 MB"),
    ("softcap", "base", 0.6, "≥ 0.6× speed of the call without"),
    ("alibi", "base", 0.6, "≥ 0.6× speed of the call without"),
]


def _summary(cases: list[Case], flops_s: float, bw: float) -> list[str]:
    by_name = {c.name: c for c in cases}
    lines = []
    for prefix, peer, goal, what in _TARGETS:
        for c in cases:
            if not c.name.startswith(prefix) or "timings" not in c.results:
                continue
            tm: dict[str, Timing] = c.results["timings"]  # type: ignore[assignment]
            ta = tm["attnkit"]
            flops_s = c.results.get("flops_s", flops_s)  # type: ignore[assignment]
            bw = c.results.get("bw", bw)  # type: ignore[assignment]
            if peer == "eff":
                if c.name.startswith("decode"):
                    val = 2 * c.batch * c.heads * c.n_k * c.d * 4 / ta.median_s / bw
                else:
                    val = 4.0 * c.batch * c.heads * c.n_q * c.n_k * c.d / ta.median_s / flops_s
                ok = val >= goal
            elif peer == "mem":
                out_mb = c.batch * c.heads * c.n_q * c.d * 4 / 2**20
                val = max(0.0, ta.peak_mb - out_mb)        # the output is allocated in the call
                ok = val <= goal
            elif peer == "base":
                base = by_name.get(c.baseline or "")
                if base is None or "timings" not in base.results:
                    continue
                val = base.results["timings"]["attnkit"].median_s / ta.median_s  # type: ignore
                ok = val >= goal
            else:
                if peer not in tm:
                    skipped = c.results.get("skipped", {})
                    lines.append(f"  {c.name:<30} vs {peer:<6} {what:<38} n/a "
                                 f"({skipped.get(peer, 'not run')})")  # type: ignore[union-attr]
                    continue
                val = tm[peer].median_s / ta.median_s
                ok = val >= goal
            unit = " MB" if peer == "mem" else ("" if peer == "eff" else "x")
            lines.append(f"  {c.name:<30} vs {peer:<6} {what:<38} {val:7.2f}{unit}  "
                         f"{'met' if ok else 'MISSED'}")
    return lines


def run_cli(argv: list[str]) -> int:
    """``attnkit bench [--quick] [--threads N] [--only SUBSTRING]``; returns the exit code."""
    ap = argparse.ArgumentParser(prog="attnkit bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, finishes in < 1 minute")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's default for this machine)")
    ap.add_argument("--only", default=None, help="run only cases whose name contains this")
    ap.add_argument("--no-flex", action="store_true", help="skip compiled FlexAttention")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    _limit_malloc_caching()
    cases = _cases(args.quick)
    if args.only:
        keep = {c.name for c in cases if args.only in c.name}
        keep |= {c.baseline for c in cases if c.name in keep and c.baseline}
        cases = [c for c in cases if c.name in keep]
    t_start = time.perf_counter()
    print(f"attnkit bench{' --quick' if args.quick else ''} — "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}, "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}, python "
          f"{sys.version.split()[0]}")
    flops_s = sgemm_flops(1024 if args.quick else 2048)
    bw = read_bandwidth(128 if args.quick else 512)
    print(f"sgemm {flops_s / 1e9:.1f} GFLOP/s, read bandwidth {bw / 1e9:.1f} GB/s "
          "(measured now)")
    if args.no_flex:
        flex: tuple[Callable | None, str] = (None, "disabled with --no-flex")
    elif args.quick:
        flex = (None, "not in --quick (torch.compile takes 5-120 s per mask on a 2-core box)")
    else:
        flex = _flex_fn()
    print("B=1, H=8, D=64 unless noted; float32. speedup = peer time / attnkit time.")
    header = f"  {'impl':<8} {'median ms':>10} {'speedup':>9} {'eff':>9} {'peak MB':>9}"
    for c in cases:
        print(f"\n{c.name}  (N_q={c.n_q}, N_k={c.n_k}, D={c.d}, mask={c.mask}"
              f"{', softcap' if c.softcap else ''}{', ' + c.score_mod if c.score_mod else ''}"
              f", {c.repeat} runs)")
        print(header)
        try:
            rows = run_case(c, bw, flex, naive_limit_gb=1.5)
        except Exception as e:  # noqa: BLE001
            print(f"  failed: {type(e).__name__}: {e}")
            continue
        for label, line in rows:
            print(f"  {label:<8} {line}")
        sys.stdout.flush()
    print("\nTargets (ratios from this run" + (
        "; --quick uses smaller sizes than the targets are set for)" if args.quick else ")")
        + ":")
    for line in _summary(cases, flops_s, bw):
        print(line)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(sys.argv[1:]))
