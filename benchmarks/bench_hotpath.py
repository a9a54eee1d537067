"""The per-call cost of small attention calls (decoding, short prefill) next to torch SDPA.

    .venv/bin/python benchmarks/bench_hotpath.py                  # every case (~1 minute)
    .venv/bin/python benchmarks/bench_hotpath.py --only decode,prefill --reps 2000
    .venv/bin/python benchmarks/bench_hotpath.py --trees OLD NEW --rounds 3   # A/B two trees

A decoder calls attention once per layer and token on tiny tensors, so the Python around the
kernel decides its speed. Each case times attnkit's call and torch's
``F.scaled_dot_product_attention`` on the same inputs, alternating one call of each
(interleaved repeats, so a load burst on this shared machine hits both), and prints both
medians and the ratio ``SDPA time / attnkit time`` (> 1 = attnkit faster). One thread
(``torch.set_num_threads(1)``, as a decoder's per-token call is measured), under
``torch.no_grad()``.

Cases (B=1, H_q=8, D=64; GQA with H_kv=2 for decode):
``decode`` (1 query × 192 keys, fp32 and bf16, through ``ak.scaled_dot_product_attention``
and through ``ak.attention``), ``decode_mask`` (what a transformers decoder step passes with
a left-padded batch: q (4,4,1,16) over 40 keys of 2 K/V heads with a (4,1,1,40) bool padding
mask, fp32, the same mask tensor twice in a row as a model's layers pass it),
``decode4096`` (1 query × 4096 keys, fp32), ``decode4096_bf16`` (issue 21's row: (1,8,1,64)
bf16 over 4096 keys of 8 K/V heads), ``prefill``
((1,8,128,64) causal, fp32), ``hf`` (a tiny transformers Llama — hidden 64, 3 layers, 4/2
heads — one forward of an 8-token prompt, ``attn_implementation="attnkit"`` vs ``"sdpa"``;
skipped without transformers). ``--threads N`` sets torch's threads (default 1).

``--trees OLD NEW``: one process per tree and round, alternating (OLD, NEW, OLD, NEW, …), each
importing attnkit from ``TREE/src``; every process prints its own lines (and its own SDPA
times, so compare ratios round by round).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

CASES = ("decode", "decode_mask", "decode4096", "decode4096_bf16", "prefill", "hf")


def cpu_name() -> str:
    """lscpu's model name (falls back to platform.processor())."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def interleaved(a: Callable[[], object], b: Callable[[], object], reps: int,
                ) -> tuple[float, float]:
    """Medians (seconds) of ``a`` and ``b``, timed alternately ``reps`` times each."""
    for _ in range(max(20, reps // 20)):             # warm-up
        a()
        b()
    ta, tb = [], []
    clock = time.perf_counter
    for _ in range(reps):
        t0 = clock()
        a()
        t1 = clock()
        b()
        t2 = clock()
        ta.append(t1 - t0)
        tb.append(t2 - t1)
    return statistics.median(ta), statistics.median(tb)


def _hf_case() -> tuple[Callable[[], object], Callable[[], object]] | str:
    """A tiny Llama's forward through attnkit and through sdpa, or why it is skipped."""
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        import attnkit.integrations.transformers as akt
    except ImportError as e:
        return f"skipped ({e})"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64)
    name = akt.register()
    ours = LlamaForCausalLM(cfg).eval()
    ours.set_attn_implementation(name)
    theirs = LlamaForCausalLM(cfg).eval()
    theirs.load_state_dict(ours.state_dict())
    theirs.set_attn_implementation("sdpa")
    ids = torch.randint(0, 128, (1, 8))
    return (lambda: ours(input_ids=ids, use_cache=False),
            lambda: theirs(input_ids=ids, use_cache=False))


def one_process(cases: list[str], reps: int, threads: int = 1) -> None:
    import torch
    import torch.nn.functional as F

    import attnkit as ak
    from attnkit.backends import native

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    print(f"CPU {cpu_name()}; torch {torch.__version__} "
          f"(capability {torch.backends.cpu.get_cpu_capability()}); attnkit "
          f"{getattr(ak, '__version__', '?')} from {os.path.dirname(ak.__file__)}; native "
          f"kernel {native.loader.cpu_flags()[0] if native.available() else 'unavailable'}; "
          f"{threads} thread(s); medians of {reps} interleaved calls", flush=True)
    print(f"  {'case':<56} {'attnkit':>10} {'SDPA':>10} {'SDPA/attnkit':>13}")

    def line(name: str, ours: Callable[[], object], theirs: Callable[[], object]) -> None:
        t_ours, t_theirs = interleaved(ours, theirs, reps)
        print(f"  {name:<56} {t_ours * 1e6:8.1f}us {t_theirs * 1e6:8.1f}us "
              f"{t_theirs / t_ours:12.2f}x", flush=True)

    def sdpa_pair(name: str, ins: list[torch.Tensor], **kw: object) -> None:
        """ak.scaled_dot_product_attention against torch's, the same call."""
        line(name, lambda: ak.scaled_dot_product_attention(*ins, **kw),
             lambda: F.scaled_dot_product_attention(*ins, **kw))

    def qkv(n_q: int, n_k: int, h_kv: int, dtype: torch.dtype) -> list[torch.Tensor]:
        return [torch.randn(1, 8, n_q, 64).to(dtype), torch.randn(1, h_kv, n_k, 64).to(dtype),
                torch.randn(1, h_kv, n_k, 64).to(dtype)]

    with torch.no_grad():
        for c in cases:
            if c == "decode":
                for dt, dn in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
                    q, k, v = qkv(1, 192, 2, dt)

                    def sdpa(q=q, k=k, v=v) -> object:
                        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                    line(f"decode {dn} (1,8,1,64) x 192 keys GQA 8/2, ak.sdpa",
                         lambda q=q, k=k, v=v: ak.scaled_dot_product_attention(
                             q, k, v, enable_gqa=True), sdpa)
                    line(f"decode {dn} (1,8,1,64) x 192 keys GQA 8/2, ak.attention",
                         lambda q=q, k=k, v=v: ak.attention(q, k, v), sdpa)
            elif c == "decode_mask":
                q, k, v = (torch.randn(4, 4, 1, 16), torch.randn(4, 2, 40, 16),
                           torch.randn(4, 2, 40, 16))
                m = torch.ones(4, 1, 1, 40, dtype=torch.bool)
                for b, pad in enumerate((9, 7, 4, 0)):
                    m[b, :, :, :pad] = False             # left padding
                sdpa_pair("decode fp32 (4,4,1,16) x 40 keys GQA 4/2, bool padding mask",
                          [q, k, v], attn_mask=m, enable_gqa=True)
            elif c == "decode4096":
                sdpa_pair("decode fp32 (1,8,1,64) x 4096 keys GQA 8/2, ak.sdpa",
                          qkv(1, 4096, 2, torch.float32), enable_gqa=True)
            elif c == "decode4096_bf16":
                sdpa_pair("decode bf16 (1,8,1,64) x 4096 keys, 8 K/V heads, ak.sdpa",
                          qkv(1, 4096, 8, torch.bfloat16))
            elif c == "prefill":
                sdpa_pair("prefill fp32 (1,8,128,64) causal, ak.sdpa",
                          qkv(128, 128, 8, torch.float32), is_causal=True)
            elif c == "hf":
                got = _hf_case()
                if isinstance(got, str):
                    print(f"  tiny Llama forward: {got}")
                else:
                    line("tiny Llama (64 hidden, 3 layers, 4/2 heads), 8 tokens", *got)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(CASES),
                    help=f"comma-separated cases, from {', '.join(CASES)}")
    ap.add_argument("--reps", type=int, default=3000, help="timed calls per case (median)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--trees", nargs="+", default=None,
                    help="A/B: two (or more) source trees, each with src/attnkit")
    ap.add_argument("--rounds", type=int, default=3, help="with --trees: processes per tree")
    args = ap.parse_args(argv)
    cases = [c for c in args.only.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    if args.reps < 1 or args.rounds < 1 or args.threads < 1:
        ap.error("--reps, --rounds and --threads must be at least 1")
    if args.trees is None:
        one_process(cases, args.reps, args.threads)
        return 0
    from ab_trees import alternating  # (this folder is on sys.path when run as a script)

    for r, tree, out in alternating(ap, args.trees, args.rounds, __file__,
                                    ["--only", ",".join(cases), "--reps", str(args.reps),
                                     "--threads", str(args.threads)]):
        print(f"round {r}, tree {tree}:", flush=True)
        print(out.stdout.rstrip() if out.returncode == 0 else out.stderr.rstrip(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
