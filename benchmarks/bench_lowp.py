"""bf16 / fp16 attention on CPU: the native kernel's low-precision GEMM path against its
widening path (``ATTNKIT_NATIVE_LOWP_GEMM=0``) and torch SDPA in the same dtype (issue 21).

Every case alternates the three calls ``--reps`` times in one process and prints medians and
ratios (SDPA time ÷ attnkit time: > 1 means attnkit is faster), with the CPU named (lscpu's
model name, torch's capability, the path the kernel takes for each dtype) and two yardsticks
measured in the same run: a 2048³ GEMM in float32 and in bfloat16. ``--terms`` adds the
bfloat16 forward with score terms (soft-cap 30, ALiBi, a compiled score_mod; causal, as
ratios to the plain causal call: 1 = free) and a 512-key sliding window at 2 N against SDPA
with the window as a dense bool mask.

    .venv/bin/python benchmarks/bench_lowp.py [--n 4096] [--reps 9] [--backward] [--terms]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

import attnkit as ak
from attnkit.backends import native
from attnkit.bench import cpu_description

SWITCH = "ATTNKIT_NATIVE_LOWP_GEMM"


def seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def medians(calls: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Each call's median time over ``reps`` rounds, the calls alternating within a round
    (after one warm-up call each)."""
    for f in calls.values():
        f()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(reps):
        for name, f in calls.items():
            times[name].append(seconds(f))
    return {name: statistics.median(ts) for name, ts in times.items()}


def gemm_flops(dtype: torch.dtype, n: int = 2048, reps: int = 5) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    return 2 * n**3 / statistics.median(seconds(lambda: a @ b) for _ in range(reps))


def case(name: str, dtype: torch.dtype, causal: bool, n: int, reps: int,
         backward: bool) -> None:
    q, k, v = (torch.randn(1, 8, n, 64).to(dtype).requires_grad_(backward) for _ in range(3))
    g = torch.randn(1, 8, n, 64).to(dtype)

    def run(f: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def go() -> None:
            if backward:
                f().backward(g)
            else:
                with torch.no_grad():
                    f()
        return go

    def attnkit(flag: str) -> Callable[[], None]:
        def f() -> torch.Tensor:
            os.environ[SWITCH] = flag
            return ak.attention(q, k, v, is_causal=causal)
        return run(f)

    impls = {"gemm": attnkit("1"), "widen": attnkit("0"),
             "sdpa": run(lambda: torch.nn.functional.scaled_dot_product_attention(
                 q, k, v, is_causal=causal))}
    med = medians(impls, reps)
    os.environ.pop(SWITCH, None)
    print(f"{name:34s} attnkit {med['gemm'] * 1e3:8.1f} ms | widening {med['widen'] * 1e3:8.1f}"
          f" ms | SDPA {med['sdpa'] * 1e3:8.1f} ms | SDPA/attnkit {med['sdpa'] / med['gemm']:5.2f}x"
          f" | widening/attnkit {med['widen'] / med['gemm']:5.2f}x", flush=True)


def terms(n: int, reps: int) -> None:
    """bf16 forward: score terms against the plain causal call, sliding window against SDPA."""
    from attnkit.scores import alibi
    q, k, v = (torch.randn(1, 8, n, 64).bfloat16() for _ in range(3))

    def mod(s: torch.Tensor, b: torch.Tensor, h: torch.Tensor, i: torch.Tensor,
            j: torch.Tensor) -> torch.Tensor:                # one function: built once
        return s + 0.01 * (i - j)

    slopes = alibi(8)
    calls = {
        "plain": lambda: ak.attention(q, k, v, is_causal=True),
        "softcap=30": lambda: ak.attention(q, k, v, is_causal=True, softcap=30.0),
        "ALiBi": lambda: ak.attention(q, k, v, is_causal=True, score_mod=slopes),
        "score_mod": lambda: ak.attention(q, k, v, is_causal=True, score_mod=mod),
    }
    qs, ks, vs = (torch.randn(1, 8, 2 * n, 64).bfloat16() for _ in range(3))
    window = ak.masks.sliding_window(512)
    dense = window.to_dense(2 * n, 2 * n)
    calls["sliding"] = lambda: ak.attention(qs, ks, vs, mask=window)
    calls["sliding SDPA"] = lambda: torch.nn.functional.scaled_dot_product_attention(
        qs, ks, vs, attn_mask=dense)
    with torch.no_grad():
        med = medians(calls, reps)
    for name in ("softcap=30", "ALiBi", "score_mod"):
        print(f"bf16 {name + ' causal fwd':28s} (1,8,{n},64) attnkit {med[name] * 1e3:8.1f} ms | "
              f"plain causal {med['plain'] * 1e3:8.1f} ms | "
              f"plain/this {med['plain'] / med[name]:5.2f}x", flush=True)
    print(f"bf16 sliding 512 fwd (1,8,{2 * n},64)        attnkit {med['sliding'] * 1e3:8.1f} ms | "
          f"SDPA dense mask {med['sliding SDPA'] * 1e3:8.1f} ms | SDPA/attnkit "
          f"{med['sliding SDPA'] / med['sliding']:5.2f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=4096, help="sequence length (default 4096)")
    ap.add_argument("--reps", type=int, default=9, help="alternating repetitions (default 9)")
    ap.add_argument("--backward", action="store_true", help="forward + backward")
    ap.add_argument("--terms", action="store_true",
                    help="also bf16 soft-cap / ALiBi / score_mod and a sliding window")
    args = ap.parse_args()
    if not native.available():
        raise SystemExit(f"the native kernel is not available: {native.why_unavailable()}")
    print(f"CPU: {cpu_description()}, torch {torch.__version__}, capability "
          f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")
    for dt, why in native.low_precision_paths().items():
        print(f"  {dt}: {why}")
    print(f"GEMM 2048³: float32 {gemm_flops(torch.float32) / 1e9:.0f} GFLOP/s, "
          f"bfloat16 {gemm_flops(torch.bfloat16) / 1e9:.0f} GFLOP/s")
    what = "fwd+bwd" if args.backward else "fwd"
    for dt, tag in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        for causal in (True, False):
            case(f"{tag} {'causal' if causal else 'dense'} {what} (1,8,{args.n},64)", dt,
                 causal, args.n, args.reps, args.backward)
    if args.terms:
        terms(args.n, args.reps)


if __name__ == "__main__":
    main()
