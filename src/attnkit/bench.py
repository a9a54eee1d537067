"""``attnkit bench``: the CPU engine side by side with its peers, in one run.

For every case the same inputs go to **attnkit** (``attention(..., backend="auto")``: the
``tiled``/``decode`` engines) and its peers: **sdpa** — torch's
``scaled_dot_product_attention`` (default CPU kernel; a structured mask becomes the
equivalent dense bool mask, causal becomes ``is_causal``); **flex** — FlexAttention compiled
with ``torch.compile`` (forward only; compile time apart; when it cannot compile, the reason
is shown); **naive** — the materialised ``softmax(QKᵀ·scale + M) V`` (skipped when its
scores would not fit comfortably); **baseline** — for an option's cost (softcap, ALiBi),
attnkit on the same call without it (softcap, ALiBi, a relative-bias table, a user Python
score_mod: the plain causal call; a float16/bfloat16 K/V cache: the float32 cache), timed in
the case's own rounds, alternating with the call it is compared with (the baseline case's
own row, timed at another moment, would fold the machine's changes into the ratio).

Columns: median time of the case's runs; ``speedup (>1 = attnkit faster)`` = peer time ÷
attnkit time; ``eff`` = useful FLOPs ÷ time ÷ the sgemm FLOP/s measured in this same case
(a bf16 / fp16 case: the GEMM in its dtype, the matrix units' speed; decode: bytes of K
and V read ÷ time ÷ the read bandwidth measured in it, ``bw``);
``peak MB`` = peak resident memory during the call beyond what was resident before it (RSS
sampled every 0.5 ms in one more, untimed run, during which large allocations are returned
to the OS at once; the timed runs reuse them, as a long-running process does); ``peer``
names what the row ran. Progress (case i of n, elapsed, time left) goes to stderr. At the end: the
**noise verdict** (:func:`noise`, from the yardsticks interleaved with every case), the
targets met or missed, and on request ``--json PATH`` (one flat record per case and
implementation) and ``--plot OUT.png``.

Shape legend: B batch, H heads (H_kv K/V heads for GQA), N sequence length, D head width;
every case is float32 unless its name says bf16/fp16 (then q, k, v all are). The
low-precision section (the cases named ``bf16 …`` / ``fp16 …``) runs torch SDPA in the same
dtype; ``native low precision`` in the header says which GEMMs the kernel runs for each.

Caution
-------
- The machine may be shared: compare ratios measured in one run, not times across runs;
  the noise verdict says how far the ratios of this run can be trusted.
- A decode case reads its K/V once per call, from memory: before each timed call (every
  implementation's) an untimed pass over the read yardstick's buffer evicts them, so no
  implementation finds them in cache because another one has just read them (the call
  timed right after another one on the same K/V ran ~25% faster here).
- Peak memory comes from RSS sampling: a spike shorter than 0.5 ms can be missed.
- The time left is an estimate from the cases' FLOPs and the speed seen so far.
- A user Python score_mod's first call (the warm-up) may compile it: that time is shown
  apart on the attnkit row ("first call") and is not in the median.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import importlib.util
import math
import os
import platform
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ._outfiles import message, output_problem
from .bench_output import plot, spread, write_json

__all__ = ["run_cli", "Case", "run_case", "measure", "noise", "PEERS"]

#: What each row ran (the ``peer`` column and the JSON's ``peer`` field).
PEERS = {"attnkit": "attnkit.attention(backend='auto')",
         "sdpa": "torch SDPA (default CPU kernel; dense bool mask for structured masks)",
         "flex": "FlexAttention, torch.compile'd (forward only)",
         "naive": "naive formula softmax(QKᵀ·scale + M)V, materialised"}
#: Above this ± (percent) spread of the yardsticks, the run is called busy.
BUSY_PCT = 5.0
_SPEED_W = 29


# ---------------------------------------------------------------------------- measuring
def _low_precision_paths() -> dict[str, str]:
    """Which GEMMs the native kernel runs for bfloat16 / float16 (forward, backward, the paged
    GEMM loop), and why; and how its decode loops multiply bfloat16."""
    from .backends import native
    from .backends.native import loader

    paths = dict(native.low_precision_paths())
    paths["bfloat16 decode"] = (
        "native kernel unavailable" if not native.available() else
        "float32 FMAs on the bf16 pairs (even dims by a shift, odd by a mask), 4 or 2 query "
        "rows per K/V head at a time; a single or leftover row by vdpbf16ps (avx512bf16 build)"
        if loader.cpu_flags()[0] == "avx512bf16" else "rows widened to float32 in registers")
    return paths


def _malloc_for(peak: bool) -> None:
    """glibc's big-block policy for the next runs. ``peak``: every block of 64 KiB or more is
    its own mapping, returned to the OS when freed, and the heap's free pages are returned
    now, so RSS follows live memory (the peak column). Else the state a long-running
    process reaches by itself (glibc raises its thresholds as big blocks are freed): blocks
    up to 32 MiB are reused, not mapped afresh, so the timed runs do not pay a page fault
    per page of every buffer (that cost attnkit's sliding-window call ~10%, and hit every
    implementation)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    mmap_threshold, trim_threshold = (1 << 16, 1 << 17) if peak else (32 << 20, 64 << 20)
    libc.mallopt(-3, mmap_threshold)       # M_MMAP_THRESHOLD (fixed from now on)
    libc.mallopt(-1, trim_threshold)       # M_TRIM_THRESHOLD
    if peak:
        libc.malloc_trim(0)                # free heap pages back too: reusing one shows in RSS


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


def _time_once(fn: Callable[[], object]) -> float:
    """Wall seconds of one call."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _peak_once(fn: Callable[[], object]) -> float:
    """Peak RSS above the start (MB) of one call, not timed: the RSS sampling thread and the
    page faults of fresh mappings would slow it."""
    _malloc_for(peak=True)
    try:
        with _PeakRSS() as pk:
            fn()
    finally:
        _malloc_for(peak=False)
    return pk.extra_mb


def measure(fn: Callable[[], object], repeat: int, warmup: int = 1) -> Timing:
    """Median wall time of ``repeat`` runs after ``warmup``, and the peak extra RSS of one
    more (untimed) run."""
    for _ in range(warmup):
        fn()
    runs = [_time_once(fn) for _ in range(repeat)]
    return Timing(statistics.median(runs), _peak_once(fn), repeat)


def sgemm_flops(n: int = 2048, repeat: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """Matmul FLOP/s of this machine in ``dtype`` (float32: sgemm), now (median of
    ``repeat``)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
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
    score_mod: str | None = None  # alibi | relbias (a learned table) | user (Python code)
    dtype: str = "float32"        # of q, k, v (float16 / bfloat16: a half-precision cache)
    kv_heads: int | None = None   # GQA: K/V heads (default: heads)
    peers: tuple[str, ...] = ("sdpa", "flex", "naive")
    repeat: int = 3
    baseline: str | None = None   # compare with attnkit on this other case name instead
    sgemm_n: int = 2048           # the interleaved sgemm yardstick: an n³ matmul
    read_mb: int = 256            # decode's interleaved read-bandwidth yardstick (MB)
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


REL_MAX_DISTANCE = 128         # the relative-bias table's reach: (H, 2·128 + 1)


def _user_score_mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    """A user-written Python score_mod (no spec, so no kernel recognises it)."""
    return score - 0.02 * (q_idx - kv_idx).abs().to(score.dtype).sqrt()


def _score_mod(c: Case) -> tuple[object, list[torch.Tensor]]:
    """→ (the case's score_mod or None, tensors of it that get gradients)."""
    import attnkit as ak

    if c.score_mod is None:
        return None, []
    if c.score_mod == "alibi":
        return ak.scores.alibi(c.heads), []
    if c.score_mod == "relbias":
        g = torch.Generator().manual_seed(1)
        table = (0.1 * torch.randn(c.heads, 2 * REL_MAX_DISTANCE + 1, generator=g)
                 ).requires_grad_(c.backward)
        return ak.scores.relative_bias(table, REL_MAX_DISTANCE), [table] if c.backward else []
    if c.score_mod == "user":
        return _user_score_mod, []
    raise ValueError(f"unknown score_mod kind {c.score_mod!r}")


def _useful_pairs(c: Case, mask: object) -> float:
    if mask is None:
        return float(c.n_q * c.n_k)
    return (1.0 - mask.sparsity(c.n_q, c.n_k)) * c.n_q * c.n_k  # type: ignore[union-attr]


def _baseline_inputs(c: Case, base: Case, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The case's inputs for its baseline's call: the same tensors, or the same values in
    the baseline's dtype (the float32 cache of a bf16 cache's case)."""
    shape = ("batch", "heads", "kv_heads", "n_q", "n_k", "d", "backward")
    if any(getattr(c, f) != getattr(base, f) for f in shape):
        raise ValueError(f"baseline {base.name!r} of {c.name!r} differs in more than its "
                         "options and dtype")
    dt = getattr(torch, base.dtype)
    if dt == q.dtype:
        return q, k, v
    return tuple(t.detach().to(dt).requires_grad_(c.backward) for t in (q, k, v))  # type: ignore[return-value]


def run_case(c: Case, bw: float, flex: tuple[Callable | None, str],
             naive_limit_gb: float, baseline: Case | None = None) -> list[tuple[str, str]]:
    """Run one case; returns printable (label, line) rows and fills ``c.results`` (its
    ``records``: one dict per implementation, as ``--json`` writes them).

    The sgemm yardstick (and, for decode, the read bandwidth) is measured inside the case,
    interleaved with the implementations; ``bw`` is used only when the case has no read
    yardstick of its own. ``baseline``: the case whose call (attnkit, same shapes, without
    this case's option) this case's is compared with — run here, interleaved run by run
    with the others, on the same inputs; the baseline case's own results are not used."""
    import attnkit as ak

    torch.manual_seed(0)
    B, H, d = c.batch, c.heads, c.d
    hkv = c.kv_heads or H
    dt = getattr(torch, c.dtype)
    q = torch.randn(B, H, c.n_q, d, dtype=dt)
    k = torch.randn(B, hkv, c.n_k, d, dtype=dt)
    v = torch.randn(B, hkv, c.n_k, d, dtype=dt)
    mask, mask_mod, dense, sdpa_causal = _mask_objects(c)
    score_mod, extra_grads = _score_mod(c)
    pairs = _useful_pairs(c, mask)
    fwd_flops = 4.0 * B * H * pairs * d
    flops = fwd_flops * (3.5 if c.backward else 1.0)
    if c.backward:
        q.requires_grad_(True)
        k.requires_grad_(True)
        v.requires_grad_(True)
    go = torch.randn(B, H, c.n_q, d, dtype=dt)

    def step(f: Callable[[], torch.Tensor],
             leaves: tuple[torch.Tensor, ...] = ()) -> Callable[[], None]:
        leaves = leaves or (q, k, v, *extra_grads)             # whose gradients it clears

        def run() -> None:
            if c.backward:
                for t in leaves:
                    t.grad = None
                f().backward(go)
            else:
                with torch.no_grad():
                    f()
        return run

    impls: dict[str, Callable[[], None]] = {}
    impls["attnkit"] = step(lambda: ak.attention(q, k, v, mask=mask, softcap=c.softcap,
                                                 score_mod=score_mod))
    if baseline is not None:                 # timed in these rounds, right after attnkit
        qb, kb, vb = _baseline_inputs(c, baseline, q, k, v)
        mask_b = _mask_objects(baseline)[0]
        mod_b, grads_b = _score_mod(baseline)
        impls["_baseline"] = step(lambda: ak.attention(qb, kb, vb, mask=mask_b,
                                                       softcap=baseline.softcap,
                                                       score_mod=mod_b),
                                  (qb, kb, vb, *grads_b))
    skipped: dict[str, str] = {}
    if "sdpa" in c.peers:
        if c.softcap is not None or score_mod is not None:
            skipped["sdpa"] = "no softcap/score_mod in torch SDPA"
        else:
            gqa = {"enable_gqa": True} if hkv != H else {}
            impls["sdpa"] = step(lambda: F.scaled_dot_product_attention(
                q, k, v, attn_mask=dense, is_causal=sdpa_causal, **gqa))
    if "naive" in c.peers:
        gb = B * H * c.n_q * c.n_k * 4 * 3 / 2**30
        if gb > naive_limit_gb:
            skipped["naive"] = f"would materialise ~{gb:.1f} GB of scores"
        elif hkv != H:
            skipped["naive"] = "not set up for GQA"
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
        elif hkv != H or dt != torch.float32:
            skipped["flex"] = "not set up for GQA / half precision"
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
    # the yardsticks run interleaved with the implementations, so they see the same machine
    n_g = c.sgemm_n
    gdt = dt if dt in (torch.bfloat16, torch.float16) else torch.float32   # the matrix units'
    ga, gb = torch.randn(n_g, n_g, dtype=gdt), torch.randn(n_g, n_g, dtype=gdt)  # speed
    impls["_sgemm"] = lambda: ga @ gb
    decode = c.name.startswith("decode")
    if decode:
        xr = torch.ones(c.read_mb * 2**20 // 4)             # far beyond the caches
        impls["_read"] = lambda: xr.sum()
    # interleave the implementations run by run, so a busy moment hits all of them
    first: dict[str, float] = {}
    for name, fn_ in impls.items():
        t0 = time.perf_counter()
        fn_()                                              # warm-up (compiles, if it does)
        first[name] = time.perf_counter() - t0
    peaks = {name: _peak_once(fn_) for name, fn_ in impls.items()   # one untimed run each
             if not name.startswith("_")}                               # (not the yardsticks)
    per: dict[str, list[float]] = {n: [] for n in impls}
    for _ in range(c.repeat):
        for name, fn_ in impls.items():
            if decode and not name.startswith("_"):
                xr.sum()                  # every decode call starts with K/V out of cache
            per[name].append(_time_once(fn_))
    timings = {n: Timing(statistics.median(per[n]), peaks.get(n, 0.0), c.repeat)
               for n in impls}
    flops_s = 2 * n_g**3 / timings.pop("_sgemm").median_s
    base_t = timings.pop("_baseline", None)
    samples = "sgemm_samples" if gdt == torch.float32 else "lowp_gemm_samples"
    c.results[samples] = [2 * n_g**3 / t for t in per["_sgemm"]]
    if "_read" in timings:
        bw = xr.numel() * 4 / timings.pop("_read").median_s
        c.results["read_samples"] = [xr.numel() * 4 / t for t in per["_read"]]
    c.results.update(timings=timings, skipped=skipped, compile_s=compile_s, flops_s=flops_s,
                     bw=bw)
    ta = timings["attnkit"].median_s
    records = []
    for name in ("attnkit", *[p for p in PEERS if p in c.peers]):
        rec: dict[str, object] = {"case": c.name, "impl": name, "peer": PEERS[name],
                                  "runs": c.repeat, "median_s": None, "ratio": None,
                                  "eff": None, "eff_of": "read bandwidth" if decode else
                                  "sgemm" if gdt == torch.float32 else f"{c.dtype} GEMM",
                                  "peak_mb": None, "skipped": skipped.get(name),
                                  "compile_s": compile_s if name == "flex" else None,
                                  "first_s": (first.get(name) if name == "attnkit"
                                              and c.score_mod == "user" else None)}
        if name in timings:
            t = timings[name].median_s
            kv_bytes = 2 * B * hkv * c.n_k * d * k.element_size()   # K and V read once
            useful = kv_bytes / bw if decode else flops / flops_s
            rec.update(median_s=t, ratio=t / ta, eff=useful / t, peak_mb=timings[name].peak_mb)
        elif name not in skipped:
            continue
        records.append(rec)
    if baseline is not None and base_t is not None:
        tb = base_t.median_s
        records.append({"case": c.name, "impl": "baseline", "runs": c.repeat,
                        "peer": f"attnkit on '{baseline.name}' (the same call without "
                                "this option, timed alternating with it; < 1 = what the "
                                "option costs)",
                        "median_s": tb, "ratio": tb / ta, "eff": None, "eff_of": None,
                        "peak_mb": None, "skipped": None, "compile_s": None,
                        "first_s": None})
    c.results["records"] = records
    return _format_rows(c)


def _gemm_yardstick(c: Case) -> tuple[str, str]:
    """(results key of the case's GEMM samples, what it measured): float32's sgemm, or a
    GEMM in the case's half dtype (the matrix units' speed) for bf16 / fp16 cases."""
    if "lowp_gemm_samples" in c.results:
        return "lowp_gemm_samples", f"{c.dtype} GEMM"
    return "sgemm_samples", "sgemm"


def _format_rows(c: Case) -> list[tuple[str, str]]:
    """The printable rows of a case that ran: (label, line)."""
    rows = []
    for r in c.results["records"]:  # type: ignore[union-attr]
        peer = r["peer"] + (f", compile {r['compile_s']:.1f} s" if r["compile_s"] else "") + (
            f"; first call {r['first_s']:.1f} s (compiling the score_mod, not in the median)"
            if r.get("first_s") else "")
        if r["median_s"] is None:
            rows.append((r["impl"], f"{'—':>10} {'':>{_SPEED_W}} {'':>9} {'':>8}  {peer}; "
                                    f"skipped: {r['skipped']}"))
            continue
        speed = "—" if r["impl"] == "attnkit" else f"{r['ratio']:.2f}x"
        eff = "" if r["eff"] is None else f"{r['eff']:.2f}" + (" bw" if r["eff_of"] ==
                                                                "read bandwidth" else "")
        peak = "" if r["peak_mb"] is None else f"{r['peak_mb']:.0f}"
        rows.append((r["impl"], f"{r['median_s'] * 1e3:10.1f} {speed:>{_SPEED_W}} {eff:>9} "
                                f"{peak:>8}  {peer}"))
    fl = c.results["flops_s"]
    key, what = _gemm_yardstick(c)
    rows.append(("", f"(yardsticks in this case: {what} {fl / 1e9:.1f} GFLOP/s "  # type: ignore
                     f"±{spread(c.results[key]):.0f}%"  # type: ignore[arg-type]
                     + (f", read {c.results['bw'] / 1e9:.1f} GB/s)"  # type: ignore[operator]
                        if "read_samples" in c.results else ")")))
    return rows


def cpu_description() -> str:
    """The CPU as a benchmark table names it: its model name (with family / model, which
    tell CPU generations apart where a hypervisor shortens the name), the vector flags that
    matter here and the ISA level the native kernel is built for."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model", "flags") and key not in info:
                    info[key] = value.strip()
                if not line.strip() and info:
                    break
    except OSError:
        pass
    name = info.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in info:
        name += f" (family {info['cpu family']}, model {info.get('model', '?')})"
    flags = set(info.get("flags", "").split())
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16") if f in flags]
    try:
        from .backends.native import loader

        level = loader.cpu_flags()[0]
    except Exception:  # noqa: BLE001 — the description must not fail the bench
        level = "unknown"
    return f"{name}; {' '.join(isa) or 'no AVX2'}; native kernel built for {level}"


def _cases(size: str) -> list[Case]:
    """The target rows of the CPU-engine issue at ``size``: "full" (~10 min), "quick" (smaller
    N, < 1 min) or "tiny" (a smoke test of the command itself, seconds; not a measurement)."""
    n, nl, w, nb, nd, ng, r = {"full": (4096, 8192, 512, 2048, 32768, 8192, 5),
                               "quick": (1024, 2048, 256, 1024, 8192, 4096, 3),
                               "tiny": (64, 128, 16, 64, 256, 256, 2)}[size]
    kw: dict = {"d": 16, "heads": 2, "sgemm_n": 128, "read_mb": 4} if size == "tiny" else {}
    rd = {"repeat": r} if size != "tiny" else {"repeat": 2}
    base = f"baseline causal fwd+bwd N={n}"
    base_fwd = f"causal fwd N={n}"
    causal_bwd = {"mask": "causal", "backward": True, "peers": (), **kw}
    causal_fwd = {"mask": "causal", "peers": (), "baseline": base_fwd, **rd, **kw}
    dec = f"decode 1x{nd} D={kw.get('d', 128)}"
    dec_kw = {"repeat": 9 if size == "full" else 3, **kw, "d": 128 if size != "tiny" else 16}
    gqa = {"heads": 32, "kv_heads": 8} if size != "tiny" else {"heads": 4, "kv_heads": 2}
    return [
        Case(f"dense fwd N={n}", n, n, **rd, **kw),
        Case(base_fwd, n, n, mask="causal", **rd, **kw),
        Case(f"soft-cap fwd N={n}", n, n, softcap=30.0, **causal_fwd),
        Case(f"alibi fwd N={n}", n, n, score_mod="alibi", **causal_fwd),
        Case(f"user score_mod fwd N={n}", n, n, score_mod="user", **causal_fwd),
        Case(f"sliding {w} fwd N={nl}", nl, nl, mask=f"sliding:{w}", **kw),
        Case(f"document {nl // w}x{w} fwd N={nl}", nl, nl, mask=f"document:{w}", **kw),
        Case(f"causal fwd+bwd N={nb}", nb, nb, mask="causal", backward=True, **rd,
             peers=("sdpa", "naive"), **kw),
        Case(f"sliding {w} fwd+bwd N={nl}", nl, nl, mask=f"sliding:{w}", backward=True,
             peers=("sdpa",), **kw),
        Case(dec, 1, nd, peers=("sdpa", "naive"), **dec_kw),
        Case(f"{dec} bf16 cache", 1, nd, dtype="bfloat16", peers=(), baseline=dec, **dec_kw),
        Case(f"{dec} fp16 cache", 1, nd, dtype="float16", peers=(), baseline=dec, **dec_kw),
        Case(f"decode GQA {gqa['heads']}/{gqa['kv_heads']} heads 1x{ng} D={dec_kw['d']}", 1, ng,
             peers=("sdpa",), **{**dec_kw, **gqa}),
        *([Case("causal fwd N=32768", 32768, 32768, mask="causal", repeat=1, peers=())]
          if size == "full" else []),
        Case(base, n, n, **causal_bwd),
        Case(f"softcap fwd+bwd N={n}", n, n, softcap=30.0, baseline=base, **causal_bwd),
        Case(f"alibi fwd+bwd N={n}", n, n, score_mod="alibi", baseline=base, **causal_bwd),
        Case(f"relative-bias table fwd+bwd N={n}", n, n, score_mod="relbias", baseline=base,
             **causal_bwd),
        Case(f"user score_mod fwd+bwd N={n}", n, n, score_mod="user", baseline=base,
             **causal_bwd),
        *_low_precision_cases(size, kw, rd),
    ]


def _low_precision_cases(size: str, kw: dict, rd: dict) -> list[Case]:
    """The low-precision section (issue 21): bf16 / fp16 calls against torch SDPA in the
    same dtype; their GEMM yardstick runs in the case's dtype (the matrix units' speed)."""
    n, nb, nl, w, nd = {"full": (4096, 2048, 8192, 512, 4096),
                        "quick": (1024, 1024, 2048, 256, 2048),
                        "tiny": (64, 64, 128, 16, 256)}[size]
    bf = {"dtype": "bfloat16", **kw}
    base_fwd, base_bwd = f"bf16 causal fwd N={n}", f"bf16 causal fwd+bwd N={nb}"
    fwd_mod = {"mask": "causal", "peers": (), "baseline": base_fwd, **rd, **bf}
    bwd_mod = {"mask": "causal", "backward": True, "peers": (), "baseline": base_bwd, **rd, **bf}
    dec_d = kw.get("d", 64)
    return [
        Case(f"bf16 dense fwd N={n}", n, n, peers=("sdpa",), **rd, **bf),
        Case(base_fwd, n, n, mask="causal", peers=("sdpa",), **rd, **bf),
        Case(f"fp16 causal fwd N={n}", n, n, mask="causal", peers=("sdpa",), **rd,
             **{**bf, "dtype": "float16"}),
        Case(f"bf16 sliding {w} fwd N={nl}", nl, nl, mask=f"sliding:{w}", peers=("sdpa",), **bf),
        Case(f"bf16 soft-cap fwd N={n}", n, n, softcap=30.0, **fwd_mod),
        Case(f"bf16 alibi fwd N={n}", n, n, score_mod="alibi", **fwd_mod),
        Case(f"bf16 user score_mod fwd N={n}", n, n, score_mod="user", **fwd_mod),
        Case(base_bwd, nb, nb, mask="causal", backward=True, peers=("sdpa",), **rd, **bf),
        Case(f"bf16 soft-cap fwd+bwd N={nb}", nb, nb, softcap=30.0, **bwd_mod),
        Case(f"bf16 alibi fwd+bwd N={nb}", nb, nb, score_mod="alibi", **bwd_mod),
        Case(f"bf16 user score_mod fwd+bwd N={nb}", nb, nb, score_mod="user", **bwd_mod),
        Case(f"decode 1x{nd} D={dec_d} bf16", 1, nd, peers=("sdpa",),
             **{**bf, "d": dec_d, "repeat": 9 if size == "full" else 3}),
    ]


# (case name pattern, peer, minimum speedup, what) — the issue's targets; "eff" rows compare
# the efficiency column instead; "mem" the attnkit peak memory (MB, maximum).
_TARGETS = [
    ("dense fwd", "sdpa", 0.95, "≥ 0.95× torch SDPA"),
    ("dense fwd", "eff", 0.85, "≥ 0.85 of sgemm throughput"),
    ("causal fwd N=(1024|4096)", "sdpa", 1.15, "≥ 1.15× torch SDPA"),
    (r"sliding \d+ fwd N", "sdpa", 20.0, "≥ 20× SDPA + dense bool mask"),
    (r"sliding \d+ fwd N", "flex", 2.0, "≥ 2× compiled FlexAttention"),
    (r"sliding \d+ fwd N", "eff", 0.75, "≥ 0.75 of sgemm on the useful pairs"),
    ("document", "sdpa", 10.0, "≥ 10× SDPA + dense bool mask"),
    (r"causal fwd\+bwd N=(1024|2048)", "sdpa", 1.1, "≥ 1.1× torch SDPA"),
    (r"sliding \d+ fwd\+bwd", "sdpa", 10.0, "≥ 10× SDPA + dense bool mask"),
    (r"decode 1x\d+ D=\d+$", "sdpa", 1.5, "≥ 1.5× torch SDPA"),
    (r"decode 1x\d+ D=\d+$", "eff", 0.7, "≥ 0.7 of read bandwidth"),
    (r"decode .* (bf16|fp16) cache", "baseline", 1.8, "≥ 1.8× the float32-cache call"),
    ("decode GQA", "sdpa", 1.5, "≥ 1.5× torch SDPA (enable_gqa=True)"),
    ("causal fwd N=32768", "mem", 128.0, "peak beyond inputs+output ≤ 128 MB"),
    ("soft-cap fwd N", "baseline", 0.85, "≥ 0.85× speed of the call without"),
    (r"softcap fwd\+bwd", "baseline", 0.8, "≥ 0.8× speed of the call without"),
    ("alibi fwd N", "baseline", 0.85, "≥ 0.85× speed of the call without"),
    (r"alibi fwd\+bwd", "baseline", 0.8, "≥ 0.8× speed of the call without"),
    ("relative-bias", "baseline", 0.7, "≥ 0.7× speed of the call without"),
    ("user score_mod fwd N", "baseline", 0.5, "≥ 0.5× speed of the call without"),
    (r"user score_mod fwd\+bwd", "baseline", 0.4, "≥ 0.4× speed of the call without"),
    # the low-precision section (issue 21): SDPA in the same dtype; eff = of the bf16 GEMM
    ("bf16 dense fwd", "sdpa", 1.0, "≥ 1.0× torch SDPA bf16"),
    ("bf16 causal fwd N", "sdpa", 1.0, "≥ 1.0× torch SDPA bf16"),
    ("bf16 causal fwd N", "eff", 0.4, "≥ 0.4 of the bf16 GEMM (aim)"),
    ("fp16 causal fwd", "sdpa", 1.0, "≥ 1.0× torch SDPA fp16"),
    (r"bf16 sliding \d+ fwd N", "sdpa", 10.0, "≥ 10× SDPA bf16 + dense bool mask"),
    (r"bf16 (soft-cap|alibi|user score_mod) fwd N", "baseline", 0.85,
     "≥ 0.85× speed of the bf16 call without"),
    (r"bf16 causal fwd\+bwd", "sdpa", 1.0, "≥ 1.0× torch SDPA bf16"),
    (r"bf16 (soft-cap|alibi|user score_mod) fwd\+bwd", "baseline", 0.8,
     "≥ 0.8× speed of the bf16 call without"),
    (r"decode 1x\d+ D=\d+ bf16$", "sdpa", 1.0, "≥ 1.0× torch SDPA bf16"),
]


def _summary(cases: list[Case], noise_pct: float, judged: bool = True) -> list[str]:
    """One line per target: the value from this run and met / MISSED (a miss smaller than
    the run's noise says so). ``judged=False`` (a --quick or --tiny run, whose sizes are not
    the ones the targets are set for) prints the values without a verdict."""
    lines = []
    for pattern, peer, goal, what in _TARGETS:
        for c in cases:
            if not re.match(pattern, c.name) or "records" not in c.results:
                continue
            recs = {r["impl"]: r for r in c.results["records"]}  # type: ignore[union-attr]
            ta = recs["attnkit"]
            if peer in ("eff", "mem"):
                if peer == "eff":
                    val, ok = ta["eff"], ta["eff"] >= goal
                else:
                    out_mb = c.batch * c.heads * c.n_q * c.d * 4 / 2**20
                    val = max(0.0, ta["peak_mb"] - out_mb)   # the output is allocated in the call
                    ok = val <= goal
            elif peer not in recs or recs[peer]["median_s"] is None:
                why = recs[peer]["skipped"] if peer in recs else "not run"
                lines.append(f"  {c.name:<30} vs {peer:<8} {what:<38} n/a ({why})")
                continue
            else:
                val = recs[peer]["ratio"]
                ok = val >= goal
            unit = " MB" if peer == "mem" else ("" if peer == "eff" else "x")
            verdict = "met" if ok else "MISSED"
            if not ok and peer != "mem" and val * (1 + noise_pct / 100) >= goal:
                verdict = "MISSED, within this run's noise"
            if not judged:
                verdict = "(not judged at this size)"
            lines.append(f"  {c.name:<30} vs {peer:<8} {what:<38} {val:7.2f}{unit}  {verdict}")
    return lines


# ---------------------------------------------------------------------------- noise, output
def noise(cases: list[Case]) -> dict[str, object]:
    """How steady the machine was: the spread of the interleaved yardsticks over the run.

    ``pct`` is :func:`spread` of the sgemm samples (every run of every case) or of the read
    samples, whichever is larger — the ± by which a machine that changed speed between two
    measurements can move a ratio. Above ``BUSY_PCT`` the verdict says the machine was busy.
    (Each JSON row also carries its own case's spread, ``yardsticks.case_spread_pct``.)"""
    sg = [x for c in cases for x in c.results.get("sgemm_samples", [])]  # type: ignore
    half: dict[str, list[float]] = {}          # the half-precision GEMMs, one list per dtype
    for c in cases:
        half.setdefault(c.dtype, []).extend(c.results.get("lowp_gemm_samples", []))  # type: ignore
    half = {dt: xs for dt, xs in half.items() if xs}
    hg = [x for xs in half.values() for x in xs]
    rd = [x for c in cases for x in c.results.get("read_samples", [])]  # type: ignore
    pct = max(spread(sg), *(spread(xs) for xs in half.values()), spread(rd))
    busy = pct > BUSY_PCT
    if not sg and not hg:
        verdict = "no yardstick samples (no case ran)"
    else:
        parts = [f"{what} yardstick {min(xs) / 1e9:.1f}–{max(xs) / 1e9:.1f} GFLOP/s over "
                 f"{len(xs)} samples" for what, xs in (("sgemm", sg),
                                                       *((f"{dt} GEMM", xs)
                                                         for dt, xs in half.items())) if xs]
        how = ", ".join(parts) + (f", read {min(rd) / 1e9:.1f}–{max(rd) / 1e9:.1f} GB/s"
                                  if rd else "")
        pm = f"±{pct:.0f}%" if pct <= 100 else "more than ±100%: do not read them"
        verdict = (f"machine busy: ratios uncertain by {pm} ({how})" if busy else
                   f"machine steady: ratios good to about ±{max(pct, 1):.0f}% ({how})")
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = []
    return {"pct": round(pct, 2), "busy": busy, "verdict": verdict,
            "samples": len(sg) + len(hg),
            "loadavg": load}


# ---------------------------------------------------------------------------- the command
class _Usage(Exception):
    pass


def _weight(c: Case) -> float:
    """A rough cost of a case (FLOPs of every implementation and yardstick, all runs), for
    the time-left estimate."""
    per = 4.0 * c.batch * c.heads * c.n_q * c.n_k * c.d * (3.5 if c.backward else 1.0)
    runs = 1 + len(c.peers) + (c.baseline is not None)         # (the baseline: timed here)
    return (c.repeat + 1) * (per * runs + 2 * c.sgemm_n**3
                             + (c.read_mb * 2**20 if c.name.startswith("decode") else 0))


def _parser() -> argparse.ArgumentParser:
    names = ", ".join(c.name for c in _cases("full"))
    ap = argparse.ArgumentParser(prog="attnkit bench", description="The CPU engine side by "
                                 "side with torch SDPA, FlexAttention and the naive formula, "
                                 "in one run; speedup = peer time / attnkit time.")
    ap.add_argument("--quick", action="store_true", help="small sizes, finishes in < 1 minute")
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # the tests' size
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's default for this machine)")
    ap.add_argument("--only", default=None, metavar="TEXT",
                    help="run only the cases whose name contains TEXT (the baselines they "
                         f"compare with come along). Cases: {names}. With --quick the sizes "
                         "are smaller; --list prints the names")
    ap.add_argument("--list", action="store_true", help="print the case names and exit")
    ap.add_argument("--no-flex", action="store_true", help="skip compiled FlexAttention")
    ap.add_argument("--json", metavar="PATH", help="also write every row as JSON (for "
                    "tracking over time: case, impl, median_s, ratio, peer, eff, yardsticks, "
                    "date, torch, threads, noise)")
    ap.add_argument("--plot", metavar="OUT.png", help="also draw the speedups against each "
                    "peer as a PNG chart (needs matplotlib: pip install \"attnkit[plot]\")")
    ap.add_argument("--force", action="store_true", help="replace an existing --json / --plot "
                    "file that attnkit bench did not write")
    return ap


def _check_out(path: str | None, flag: str) -> None:
    if path and os.path.isdir(path):
        raise _Usage(f"{flag} {path} is a folder: give a file name inside it")
    if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise _Usage(f"{flag} {path}: the folder {os.path.dirname(os.path.abspath(path))} "
                     "does not exist")


def run_cli(argv: list[str]) -> int:
    """``attnkit bench [--quick] [--threads N] [--only TEXT] [--list] [--json PATH]
    [--plot OUT.png] [--no-flex] [--force]``; returns the exit code (2: bad usage)."""
    args = _parser().parse_args(argv)
    size = "tiny" if args.tiny else "quick" if args.quick else "full"
    cases = _cases(size)
    if args.only:
        keep = {c.name for c in cases if args.only in c.name}
        keep |= {c.baseline for c in cases if c.name in keep and c.baseline}
        cases = [c for c in cases if c.name in keep]
    if args.list:
        for c in cases:
            peers = ", ".join(c.peers) or (f"baseline '{c.baseline}'" if c.baseline else "—")
            hkv = f" H_kv={c.kv_heads}" if c.kv_heads else ""
            print(f"{c.name:<32}  N_q={c.n_q} N_k={c.n_k} D={c.d} H={c.heads}{hkv} {c.dtype} "
                  f"mask={c.mask}"
                  f"{' fwd+bwd' if c.backward else ''}; peers: {peers}")
        return 0
    try:
        if not cases:
            raise _Usage(f"--only {args.only!r} matches no case; --list prints the names")
        _check_out(args.json, "--json")
        _check_out(args.plot, "--plot")
        # not one file for both, nor over a file that is not an earlier output of its kind
        problem = output_problem("--json", args.json, "json", force=args.force) or \
            output_problem("--plot", args.plot, "png", earlier=[("--json", args.json)],
                           force=args.force)
        if problem is not None:
            raise _Usage(message(problem))
        if args.plot and importlib.util.find_spec("matplotlib") is None:
            raise _Usage('--plot needs matplotlib, which is not installed: '
                         'pip install "attnkit[plot]"')
    except _Usage as e:
        print(f"attnkit bench: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    _malloc_for(peak=False)
    t_start = time.perf_counter()
    date = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    print(f"attnkit bench{' --quick' if args.quick else ''} — {date}")
    cpu = cpu_description()
    print(f"CPU: {cpu}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}, python "
          f"{sys.version.split()[0]}")
    lowp = _low_precision_paths()
    print("native low precision: " + "; ".join(f"{k}: {v}" for k, v in lowp.items()))
    small = {"tiny": (128, 4), "quick": (1024, 128), "full": (2048, 512)}[size]
    flops_s = sgemm_flops(small[0])
    bw = read_bandwidth(small[1])
    bf_s = sgemm_flops(small[0], dtype=torch.bfloat16)
    print(f"sgemm {flops_s / 1e9:.1f} GFLOP/s, bf16 GEMM {bf_s / 1e9:.1f} GFLOP/s, read "
          f"bandwidth {bw / 1e9:.1f} GB/s (measured now)")
    if args.no_flex:
        flex: tuple[Callable | None, str] = (None, "disabled with --no-flex")
    elif size != "full":
        flex = (None, "not in --quick (torch.compile takes 5-120 s per mask on a 2-core box)")
    else:
        flex = _flex_fn()
    print("float32 unless a case's name says bf16 / fp16 (then torch SDPA in the same dtype, "
          "and eff is of a GEMM in that dtype), B=1; sizes in each case's heading. Each row: "
          "the median time of the case's runs, implementations interleaved run by run.\n"
          "speedup = peer time / attnkit time (>1 = attnkit faster); eff = useful FLOP/s / "
          "the sgemm FLOP/s measured in the same case (decode: K/V bytes read per s / the "
          "read bandwidth, 'bw').")
    header = (f"  {'impl':<8} {'median ms':>10} {'speedup (>1 = attnkit faster)':>{_SPEED_W}} "
              f"{'eff':>9} {'peak MB':>8}  peer")
    by_name = {c.name: c for c in cases}
    weights = [_weight(c) for c in cases]
    rate = flops_s * 0.5                       # FLOPs per second, until a case has been timed
    t_cases = 0.0
    for i, c in enumerate(cases):
        eta = sum(weights[i:]) / rate + (0 if flex[0] is None else 30.0 * (i == 0))
        print(f"[bench] case {i + 1} of {len(cases)}: {c.name} — "
              f"{time.perf_counter() - t_start:.0f} s elapsed, about {eta:.0f} s left",
              file=sys.stderr, flush=True)
        print(f"\n{c.name}  (N_q={c.n_q}, N_k={c.n_k}, H={c.heads}"
              f"{f', H_kv={c.kv_heads}' if c.kv_heads else ''}, D={c.d}, {c.dtype}, mask={c.mask}"
              f"{', softcap' if c.softcap else ''}{', ' + c.score_mod if c.score_mod else ''}"
              f", median of {c.repeat} run{'s' if c.repeat != 1 else ''})")
        print(header, flush=True)
        t0 = time.perf_counter()
        try:
            rows = run_case(c, bw, flex, naive_limit_gb=1.5,
                            baseline=by_name.get(c.baseline or ""))
        except Exception as e:  # noqa: BLE001
            c.results["error"] = f"{type(e).__name__}: {e}"
            print(f"  failed: {c.results['error']}")
            rows = []
        t_cases += time.perf_counter() - t0
        rate = sum(weights[: i + 1]) / max(t_cases, 1e-9)
        for label, line in rows:
            print(f"  {label:<8} {line}")
        sys.stdout.flush()
    total = time.perf_counter() - t_start
    print(f"[bench] done: {len(cases)} case{'s' if len(cases) != 1 else ''} in {total:.0f} s",
          file=sys.stderr, flush=True)
    nz = noise(cases)
    print(f"\nNoise: {nz['verdict']}.")
    print("\nTargets (ratios from this run" + (
        "; the targets are set for the full sizes: run without --quick to judge them)"
        if size != "full" else ")") + ":")
    for line in _summary(cases, nz["pct"], judged=size == "full"):  # type: ignore[arg-type]
        print(line)
    print(f"\ntotal {total:.0f} s")
    meta = {"date": date, "command": "attnkit bench " + " ".join(argv),
            "attnkit": sys.modules["attnkit"].__version__, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "python": sys.version.split()[0],
            "cpu": cpu,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "low_precision": lowp,
            "yardsticks": {"sgemm_flops": flops_s, "bf16_gemm_flops": bf_s, "read_bw": bw},
            "noise": nz,
            "total_s": total}
    if args.json:
        write_json(args.json, meta, cases)
        print(f"attnkit bench: wrote {args.json}", file=sys.stderr)
    if args.plot:
        plot(args.plot, cases, meta)
        print(f"attnkit bench: wrote {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(sys.argv[1:]))
