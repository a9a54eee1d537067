"""GPU benchmark: attnkit's triton backend vs torch SDPA and FlexAttention, as ratios.

    python benchmarks/bench_triton.py                 # the default grid (one GPU, ~minutes)
    python benchmarks/bench_triton.py --quick         # two shapes, to see that it runs
    python benchmarks/bench_triton.py --no-flex       # skip FlexAttention (slow to compile)
    python benchmarks/bench_triton.py --compile-only 90   # no GPU needed: compile every kernel
                                                          # variant for sm_90 and report

Each row times the forward and forward+backward of one problem (median of CUDA-event timed
repetitions after warm-up) for:

- ``triton``  ``attnkit.attention(..., backend="triton")``
- ``sdpa``    ``torch.nn.functional.scaled_dot_product_attention`` (FlashAttention-2 /
  cuDNN / memory-efficient kernels, whichever torch picks)
- ``flex``    ``torch.nn.attention.flex_attention`` under ``torch.compile`` (block mask)

and prints ``sdpa/triton`` and ``flex/triton`` (> 1 means triton is faster), the TFLOP/s of
triton, and the largest difference of triton's output from SDPA's. Without a CUDA device it
prints a message and exits with status 0 (``--compile-only`` works without one).

Shape legend: q (B, H_q, N, D), k and v (B, H_kv, N, D).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import attnkit as ak


@dataclass(frozen=True)
class Case:
    b: int
    h_q: int
    h_kv: int
    n: int
    d: int
    mask: str            # "none" | "causal" | "window256"
    dtype: torch.dtype

    def __str__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        return (f"B{self.b} H{self.h_q}/{self.h_kv} N{self.n} D{self.d} {self.mask:<9} {dt}")

    def flops(self, backward: bool) -> float:
        """Matmul FLOPs (4·N²·D per head forward; 2.5× that for forward + backward), halved
        for causal; the window counts only the pairs it keeps."""
        pairs = self.n * self.n
        if self.mask == "causal":
            pairs = self.n * (self.n + 1) / 2
        elif self.mask.startswith("window"):
            w = int(self.mask[len("window"):])
            pairs = sum(min(i + 1, w) for i in range(self.n))
        f = 4.0 * self.b * self.h_q * pairs * self.d
        return f * (3.5 if backward else 1.0)


def _cases(quick: bool) -> list[Case]:
    if quick:
        return [Case(2, 8, 8, 1024, 64, "none", torch.float16),
                Case(2, 8, 2, 1024, 128, "causal", torch.bfloat16)]
    out = []
    for n in (1024, 4096, 8192):
        b = max(1, 16384 // n)
        for mask in ("none", "causal"):
            out.append(Case(b, 16, 16, n, 128, mask, torch.bfloat16))
        out.append(Case(b, 32, 8, n, 128, "causal", torch.bfloat16))     # GQA 4:1
        out.append(Case(b, 16, 16, n, 64, "causal", torch.float16))
    out.append(Case(1, 16, 16, 8192, 128, "window256", torch.bfloat16))
    out.append(Case(1, 16, 16, 2048, 128, "causal", torch.float32))
    return out


def _time_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _inputs(c: Case, grad: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda h: torch.randn(c.b, h, c.n, c.d, device="cuda", dtype=c.dtype,  # noqa: E731
                               generator=g).requires_grad_(grad)
    return mk(c.h_q), mk(c.h_kv), mk(c.h_kv)


def _ak_mask(c: Case) -> ak.masks.Mask | None:
    if c.mask == "causal":
        return ak.masks.causal()
    if c.mask.startswith("window"):
        return ak.masks.sliding_window(int(c.mask[len("window"):]))
    return None


def _sdpa(c: Case) -> Callable[..., torch.Tensor] | None:
    if c.mask.startswith("window"):
        w = int(c.mask[len("window"):])
        i = torch.arange(c.n, device="cuda")
        d = i[:, None] - i[None, :]
        allowed = (d >= 0) & (d < w)                      # dense bool mask: SDPA's only way
        return lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, enable_gqa=c.h_q != c.h_kv)
    return lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, is_causal=c.mask == "causal", enable_gqa=c.h_q != c.h_kv)


def _flex(c: Case) -> Callable[..., torch.Tensor] | None:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    block_mask = None
    if c.mask != "none":
        w = int(c.mask[len("window"):]) if c.mask.startswith("window") else None

        def mask_mod(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
            keep = q_idx >= kv_idx
            if w is not None:
                keep = keep & (q_idx - kv_idx < w)
            return keep

        block_mask = create_block_mask(mask_mod, None, None, c.n, c.n, device="cuda")
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask,
                                    enable_gqa=c.h_q != c.h_kv)


def _fwd_bwd(fn: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, d_out: torch.Tensor) -> Callable[[], object]:
    def step() -> None:
        out = fn(q, k, v)
        torch.autograd.backward(out, d_out)
        q.grad = k.grad = v.grad = None
    return step


def _bench(c: Case, reps: int, flex: bool) -> None:
    mask = _ak_mask(c)
    peers: dict[str, Callable[..., torch.Tensor] | None] = {
        "triton": lambda q, k, v: ak.attention(q, k, v, mask=mask, backend="triton"),
        "sdpa": _sdpa(c),
    }
    if flex:
        peers["flex"] = _flex(c)
    q, k, v = _inputs(c, grad=True)
    d_out = torch.randn_like(q)
    fwd_ms: dict[str, float] = {}
    both_ms: dict[str, float] = {}
    outs: dict[str, torch.Tensor] = {}
    for name, fn in peers.items():
        if fn is None:
            continue
        try:
            with torch.no_grad():
                outs[name] = fn(q, k, v)
                fwd_ms[name] = _time_ms(lambda fn=fn: fn(q, k, v), reps)
            both_ms[name] = _time_ms(_fwd_bwd(fn, q, k, v, d_out), reps)
        except Exception as e:  # a peer that cannot run this case is reported, not fatal
            print(f"  {name}: failed ({type(e).__name__}: {str(e).splitlines()[0][:100]})")
        torch.cuda.empty_cache()
    t = fwd_ms.get("triton")
    tb = both_ms.get("triton")
    cells = [f"{c!s:<44}"]
    if t is not None and tb is not None:
        cells.append(f"fwd {t:7.3f} ms {c.flops(False) / t / 1e9:6.1f} TF/s | "
                     f"fwd+bwd {tb:7.3f} ms {c.flops(True) / tb / 1e9:6.1f} TF/s")
        for peer in ("sdpa", "flex"):
            if peer in fwd_ms and peer in both_ms:
                cells.append(f"{peer}/triton fwd {fwd_ms[peer] / t:5.2f}x "
                             f"fwd+bwd {both_ms[peer] / tb:5.2f}x")
        if "sdpa" in outs and "triton" in outs:
            err = (outs["triton"].float() - outs["sdpa"].float()).abs().max().item()
            cells.append(f"max|triton-sdpa| {err:.2e}")
    print("  ".join(cells), flush=True)


def _compile_only(arch: int) -> int:
    """Compile every kernel for ``sm_<arch>`` in five variants (fp16 without masks and with
    every feature on, bf16 with a band, fp32 and fp64 with every feature on) — no GPU needed;
    reports compile time and shared memory per kernel."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget

    from attnkit.backends.triton import _kernels

    kern = _kernels(False)
    pointers = {"Q", "K", "V", "O", "DO", "DQ", "DK", "DV", "Lse", "DLse", "Delta", "Mask",
                "Bias", "DBias", "KvLen", "QLen", "QIds", "KIds", "Tiles"}
    pointer_types = {"Mask": "*u8", "Tiles": "*i8", "KvLen": "*i32", "QLen": "*i32",
                     "QIds": "*i64", "KIds": "*i64"}
    target = GPUTarget("cuda", arch, 32)
    backend = triton.compiler.make_backend(target)
    failures = 0
    every = ("HAS_BAND", "HAS_MASK", "HAS_BIAS", "HAS_KVLEN", "HAS_QLEN", "HAS_DOC",
             "HAS_TILES", "HAS_DROPOUT", "HAS_SOFTCAP", "HAS_DLSE", "HAS_DBIAS")
    variants = (("fp16", "fp32", tl.float32, 128, 64, ()),                # no mask at all
                ("fp16", "fp32", tl.float32, 128, 64, every),
                ("bf16", "fp32", tl.float32, 128, 64, ("HAS_BAND",)),     # causal / window
                ("fp32", "fp32", tl.float32, 64, 32, every),
                ("fp64", "fp64", tl.float64, 32, 32, every))
    for io, acc, acc_tl, bm, bn, on in variants:
        for fn in (kern._fwd_kernel, kern._bwd_delta_kernel, kern._bwd_dq_kernel,
                   kern._bwd_dkdv_kernel):
            const = {flag: flag in on for flag in every}
            const.update(ACC=acc_tl, PRECISION="ieee", BLOCK_M=bm, BLOCK_N=bn, BLOCK_DK=128,
                         BLOCK_DV=128)
            const = {k: v for k, v in const.items() if k in fn.arg_names}
            sig = {}
            for name in fn.arg_names:
                if name in const:
                    sig[name] = "constexpr"
                elif name in pointers:
                    in_acc = name in ("Lse", "DLse", "Delta", "Bias", "DBias")
                    sig[name] = pointer_types.get(name) or (f"*{acc}" if in_acc else f"*{io}")
                elif name in ("scale", "softcap", "drop_p", "inv_keep"):
                    sig[name] = "fp32"
                else:
                    sig[name] = "i32"
            opts = backend.parse_options({"num_warps": 4, "num_stages": 2})
            start = time.time()
            try:
                cc = triton.compile(triton.compiler.ASTSource(fn, sig, const), target=target,
                                    options=opts.__dict__)
                print(f"sm_{arch} {io:<5} {len(on)} flags {fn.__name__:<18} ok   "
                      f"{time.time() - start:5.1f} s  shared {cc.metadata.shared / 1024:6.1f} KiB",
                      flush=True)
            except Exception as e:
                failures += 1
                print(f"sm_{arch} {io:<5} {fn.__name__:<18} FAIL {type(e).__name__}: "
                      f"{str(e)[:300]}", flush=True)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="two small shapes")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per measurement")
    ap.add_argument("--compile-only", type=int, metavar="ARCH", default=None,
                    help="compile the kernels for sm_ARCH (e.g. 90) without a GPU, then exit")
    args = ap.parse_args(argv)
    if args.compile_only is not None:
        return _compile_only(args.compile_only)
    if not torch.cuda.is_available():
        print("bench_triton: no CUDA device — this benchmark needs a GPU (try --compile-only 90 "
              "to check that the kernels compile). Nothing to do.")
        return 0
    if "triton" not in ak.backends.names():
        print("bench_triton: the triton backend is not registered. Nothing to do.")
        return 0
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"triton {__import__('triton').__version__}")
    print("ratios are peer time / triton time: > 1 means triton is faster")
    for c in _cases(args.quick):
        _bench(c, args.reps, flex=not args.no_flex)
    return 0


if __name__ == "__main__":
    sys.exit(main())
