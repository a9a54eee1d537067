"""bf16 / fp16 attention on CPU: the native kernel's low-precision GEMM path against its
widening path (``ATTNKIT_NATIVE_LOWP_GEMM=0``) and torch SDPA in the same dtype (issue 21).

Every case alternates the three calls ``--reps`` times in one process and prints medians and
ratios (SDPA time ÷ attnkit time: > 1 means attnkit is faster), with the CPU named (lscpu's
model name, torch's capability, the path the kernel takes for each dtype) and two yardsticks
measured in the same run: a 2048³ GEMM in float32 and in bfloat16.

    .venv/bin/python benchmarks/bench_lowp.py [--n 4096] [--reps 9] [--backward]
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
    for f in impls.values():
        f()
    times: dict[str, list[float]] = {name: [] for name in impls}
    for _ in range(reps):
        for key, f in impls.items():
            times[key].append(seconds(f))
    os.environ.pop(SWITCH, None)
    med = {key: statistics.median(ts) for key, ts in times.items()}
    print(f"{name:34s} attnkit {med['gemm'] * 1e3:8.1f} ms | widening {med['widen'] * 1e3:8.1f}"
          f" ms | SDPA {med['sdpa'] * 1e3:8.1f} ms | SDPA/attnkit {med['sdpa'] / med['gemm']:5.2f}x"
          f" | widening/attnkit {med['widen'] / med['gemm']:5.2f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=4096, help="sequence length (default 4096)")
    ap.add_argument("--reps", type=int, default=9, help="alternating repetitions (default 9)")
    ap.add_argument("--backward", action="store_true", help="forward + backward")
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


if __name__ == "__main__":
    main()
