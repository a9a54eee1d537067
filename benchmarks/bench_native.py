"""attnkit's native CPU kernel side by side with its peers, measured in the same run.

    .venv/bin/python benchmarks/bench_native.py            # issue-11 sizes (~2–4 min)
    .venv/bin/python benchmarks/bench_native.py --quick    # small sizes, < 1 minute
    .venv/bin/python benchmarks/bench_native.py --only decode

Every row is a median over ``--reps`` rounds (after one warm-up) of a ratio against a peer
timed in the same round (so a load burst hits both alike): torch SDPA, attnkit's ``tiled``
/ ``decode`` Python engines ("today": ``tiled.use_native(False)``, as before the kernel),
the same native call without the score term, or the machine's own read bandwidth / sgemm
rate.
Speed ratios are ``peer time / native time`` (> 1 = native faster); fractions of bandwidth
or sgemm are ``achieved / measured peak``. Shapes: fp32, B=1, H=8, D=64 unless the row
says otherwise. On a shared machine, run it when the machine is quiet and quote medians.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import attnkit as ak
from attnkit.backends import native
from attnkit.backends.tiled import use_native
from attnkit.scores import alibi, alibi_slopes


def _today(*args: object, **kw: object) -> torch.Tensor:
    """attnkit's Python engines, as ``tiled``/``decode`` ran before the native kernel (they
    use the kernel themselves now)."""
    with use_native(False):
        return ak.attention(*args, **kw)  # type: ignore[arg-type]


def median_time(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rounds(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, list[float]]:
    """Each call once per round, round after round (so load bursts hit all alike)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def ratio(t: dict[str, list[float]], a: str, b: str) -> float:
    """Median over rounds of ``t[a] / t[b]``."""
    return statistics.median(x / y for x, y in zip(t[a], t[b], strict=True))


def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


def row(name: str, value: float, unit: str, target: str = "") -> None:
    print(f"  {name:<58} {value:7.2f} {unit:<14} {target}")


def forward_rows(n: int, reps: int) -> None:
    H, D = 8, 64
    q, k, v = rand(1, H, n, D), rand(1, H, n, D), rand(1, H, n, D)
    causal = (0, math.inf)
    slopes = alibi_slopes(H)
    t = rounds({
        "sdpa_causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "sdpa_dense": lambda: F.scaled_dot_product_attention(q, k, v),
        "native_causal": lambda: native.forward(q, k, v, band=causal),
        "native_dense": lambda: native.forward(q, k, v),
        "native_softcap": lambda: native.forward(q, k, v, band=causal, softcap=30.0),
        "native_alibi": lambda: native.forward(q, k, v, band=causal, alibi_slopes=slopes),
        "tiled_causal": lambda: _today(q, k, v, is_causal=True, backend="tiled"),
        "tiled_softcap": lambda: _today(q, k, v, is_causal=True, softcap=30.0,
                                              backend="tiled"),
        "tiled_alibi": lambda: _today(q, k, v, is_causal=True, score_mod=alibi(H),
                                            backend="tiled"),
    }, reps)
    print(f"forward, N={n} (fp32, B=1, H={H}, D={D})")
    row("causal: native vs torch SDPA", ratio(t, "sdpa_causal", "native_causal"), "x speed",
        "target >= 0.95")
    row("dense: native vs torch SDPA", ratio(t, "sdpa_dense", "native_dense"), "x speed",
        "target >= 0.95")
    row("causal: native vs tiled (today)", ratio(t, "tiled_causal", "native_causal"), "x speed")
    row("softcap=30 causal: native, vs native plain causal",
        ratio(t, "native_causal", "native_softcap"), "x plain", "target >= 0.85")
    row("softcap=30 causal: tiled (today), vs tiled plain causal",
        ratio(t, "tiled_causal", "tiled_softcap"), "x plain")
    row("softcap=30 causal: native vs tiled", ratio(t, "tiled_softcap", "native_softcap"),
        "x speed")
    row("ALiBi causal: native, vs native plain causal", ratio(t, "native_causal", "native_alibi"),
        "x plain", "target >= 0.85")
    row("ALiBi causal: tiled score_mod (today), vs tiled plain",
        ratio(t, "tiled_causal", "tiled_alibi"), "x plain")
    row("ALiBi causal: native vs tiled", ratio(t, "tiled_alibi", "native_alibi"), "x speed")


def backward_rows(n: int, reps: int) -> None:
    H, D = 8, 64
    q, k, v = (rand(1, H, n, D).requires_grad_() for _ in range(3))
    dout = rand(1, H, n, D)
    causal, slopes = (0, math.inf), alibi_slopes(H)

    def fwd_bwd(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        return lambda: fn().backward(dout)

    with torch.enable_grad():
        t = rounds({
            "sdpa": fwd_bwd(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
            "tiled": fwd_bwd(lambda: _today(q, k, v, is_causal=True, backend="tiled")),
            "native": fwd_bwd(lambda: native.forward(q, k, v, band=causal)[0]),
            "softcap": fwd_bwd(lambda: native.forward(q, k, v, band=causal, softcap=30.0)[0]),
            "alibi": fwd_bwd(lambda: native.forward(q, k, v, band=causal,
                                                    alibi_slopes=slopes)[0]),
        }, reps)
    print(f"forward+backward, causal, N={n} (fp32, B=1, H={H}, D={D})")
    row("native vs torch SDPA", ratio(t, "sdpa", "native"), "x speed", "target >= 1.0")
    row("native vs tiled (today)", ratio(t, "tiled", "native"), "x speed")
    row("softcap=30: native, vs native plain", ratio(t, "native", "softcap"), "x plain",
        "target >= 0.8")
    row("ALiBi: native, vs native plain", ratio(t, "native", "alibi"), "x plain",
        "target >= 0.8")


def sgemm_rate(reps: int) -> float:
    a, b = rand(2048, 2048), rand(2048, 2048)
    return 2 * 2048**3 / median_time(lambda: a @ b, reps)


def window_rows(n: int, reps: int) -> None:
    H, D, w = 8, 64, 512
    q, k, v = rand(1, H, n, D), rand(1, H, n, D), rand(1, H, n, D)
    t = rounds({
        "native": lambda: native.forward(q, k, v, band=(0, w - 1)),
        "tiled": lambda: _today(q, k, v, mask=ak.masks.sliding_window(w), backend="tiled"),
    }, reps)
    t_native = statistics.median(t["native"])
    pairs = sum(min(i + 1, w) for i in range(n))
    useful = 4 * pairs * D * H / t_native
    print(f"sliding window {w}, N={n} (fp32, B=1, H={H}, D={D})")
    row("native, fraction of 2048^3 sgemm rate on useful pairs", useful / sgemm_rate(reps),
        "of sgemm", "target >= 0.75")
    row("native vs tiled (today)", ratio(t, "tiled", "native"), "x speed")


def decode_rows(n: int, reps: int) -> None:
    H, D = 8, 128
    q, k, v = rand(1, H, 1, D), rand(1, H, n, D), rand(1, H, n, D)
    kv = torch.cat([k.reshape(-1), v.reshape(-1)])
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    qh, kh, vh = q.half(), k.half(), v.half()
    t = rounds({
        "read": lambda: kv.sum(),
        "native": lambda: native.decode(q, k, v),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
        "decode": lambda: _today(q, k, v, backend="decode"),
        "bf16": lambda: native.decode(qb, kb, vb),
        "fp16": lambda: native.decode(qh, kh, vh),
    }, reps)
    t_read = statistics.median(t["read"])
    print(f"decode, 1 query x {n} keys (B=1, H={H}, D={D})")
    row("fp32 cache: fraction of read bandwidth (sum of K+V)", ratio(t, "read", "native"),
        "of bandwidth", f"target >= 0.7 ({kv.numel() * 4 / t_read / 1e9:.1f} GB/s)")
    row("fp32 cache: native vs torch SDPA", ratio(t, "sdpa", "native"), "x speed", "target >= 1.5")
    row("fp32 cache: native vs attnkit decode (today)", ratio(t, "decode", "native"), "x speed")
    row("bfloat16 cache vs fp32 cache (native)", ratio(t, "native", "bf16"),
        "x speed", "target >= 1.7")
    row("float16 cache vs fp32 cache (native)", ratio(t, "native", "fp16"),
        "x speed", "target >= 1.7")
    hq, hkv, nk = 32, 8, n // 4
    q, k, v = rand(1, hq, 1, D), rand(1, hkv, nk, D), rand(1, hkv, nk, D)
    t = rounds({
        "native": lambda: native.decode(q, k, v),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
    }, reps)
    row(f"GQA {hq} q heads over {hkv} K/V heads, {nk} keys: native vs SDPA (enable_gqa)",
        ratio(t, "sdpa", "native"), "x speed", "target >= 1.5")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (< 1 minute)")
    ap.add_argument("--reps", type=int, default=None, help="timed runs per call (median)")
    ap.add_argument("--only", choices=("forward", "backward", "window", "decode"), default=None)
    args = ap.parse_args(argv)
    if not native.available():
        print(f"native kernel unavailable: {native.why_unavailable()}")
        return 1
    reps = args.reps or (3 if args.quick else 5)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU level {native.loader.cpu_flags()[0]}; medians of {reps} runs")
    with torch.no_grad():
        if args.only in (None, "forward"):
            forward_rows(1024 if args.quick else 4096, reps)
        if args.only in (None, "backward"):
            backward_rows(512 if args.quick else 2048, reps)
        if args.only in (None, "window"):
            window_rows(2048 if args.quick else 8192, reps)
        if args.only in (None, "decode"):
            decode_rows(8192 if args.quick else 32768, reps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
