"""A tiny Hugging Face Llama's ``generate()`` through attnkit next to transformers' ``sdpa``.

    .venv/bin/python benchmarks/bench_hf_generate.py                 # 7 rounds (~1 minute)
    .venv/bin/python benchmarks/bench_hf_generate.py --rounds 15 --threads 2
    .venv/bin/python benchmarks/bench_hf_generate.py --dtype bfloat16   # the model in bf16
    .venv/bin/python benchmarks/bench_hf_generate.py --trees OLD NEW --ab-rounds 3   # A/B

The model is built from a config (random weights, nothing downloaded): hidden 64, 3 layers,
4 query heads over 2 K/V heads (GQA), vocabulary 128. Four prompts of different lengths
(3, 5, 8 and 12 tokens) are left-padded into one batch, so transformers passes a 4-D padding
mask to every attention call (the prefill's and each decoding step's), and ``generate``
makes 64 new tokens greedily with the KV cache (``min_new_tokens`` = ``max_new_tokens``, so
every run does the same work). The same weights run with ``attn_implementation="attnkit"``
and ``"sdpa"``, alternating one ``generate`` of each per round (a load burst on a shared
machine hits both); the script checks that both produce the same tokens and prints the
medians and the ratio ``sdpa time / attnkit time`` (> 1 = attnkit faster), with the CPU
(lscpu's model name and ``torch.backends.cpu.get_cpu_capability()``). Target (issue 20):
≥ 0.95×. Skipped (exit 0, one line) without transformers.

``--dtype bfloat16`` / ``float16``: the model's weights (and so every attention call) in that
dtype, as models are served. Two kernels rounding differently may then pick a different
token where two logits tie in that precision, after which the continuations differ: the
script prints how many of the batch's sequences came out the same instead of failing
(float32 still requires all of them equal).

``--trees OLD NEW``: one process per tree and A/B round, alternating (OLD, NEW, OLD, …),
each importing attnkit from ``TREE/src`` (``benchmarks/ab_trees.py``); compare the ratios
round by round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from bench_hotpath import cpu_name  # (this folder is on sys.path when run as a script)

PROMPTS = (3, 5, 8, 12)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7, help="generate() calls per side (median)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per call")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                    help="the model's dtype (default float32)")
    ap.add_argument("--trees", nargs="+", default=None,
                    help="A/B: two (or more) source trees, each with src/attnkit")
    ap.add_argument("--ab-rounds", type=int, default=3, help="with --trees: processes per tree")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.new_tokens < 1 or args.threads < 1 or args.ab_rounds < 1:
        ap.error("--rounds, --new-tokens, --threads and --ab-rounds must be at least 1")
    if args.trees is not None:
        from ab_trees import alternating

        for r, tree, out in alternating(ap, args.trees, args.ab_rounds, __file__,
                                        ["--rounds", str(args.rounds), "--new-tokens",
                                         str(args.new_tokens), "--threads",
                                         str(args.threads), "--dtype", args.dtype]):
            print(f"round {r}, tree {tree}:", flush=True)
            print(out.stdout.rstrip() if out.returncode == 0 else out.stderr.rstrip(),
                  flush=True)
        return 0
    import torch

    try:
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        print(f"tiny Llama generate: skipped ({e})")
        return 0
    import attnkit as ak
    import attnkit.integrations.transformers as akt
    from attnkit.backends import native

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval().to(getattr(torch, args.dtype))
    name = akt.register()
    n = max(PROMPTS)
    ids = torch.zeros(len(PROMPTS), n, dtype=torch.long)
    mask = torch.zeros(len(PROMPTS), n, dtype=torch.long)
    for i, length in enumerate(PROMPTS):                  # left padding: real tokens last
        ids[i, n - length:] = torch.randint(3, cfg.vocab_size, (length,))
        mask[i, n - length:] = 1
    gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
               do_sample=False, pad_token_id=0)

    def run(impl: str) -> tuple[float, torch.Tensor]:
        model.set_attn_implementation(impl)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, **gen)
        return time.perf_counter() - t0, out

    print(f"CPU {cpu_name()} (torch capability {torch.backends.cpu.get_cpu_capability()}); "
          f"torch {torch.__version__}, transformers {transformers.__version__}, attnkit "
          f"{getattr(ak, '__version__', '?')} from {os.path.dirname(ak.__file__)}; native kernel "
          f"{native.loader.cpu_flags()[0] if native.available() else 'unavailable'}; "
          f"{args.threads} thread(s); model in {args.dtype}", flush=True)
    print(f"tiny Llama (hidden 64, 3 layers, 4/2 heads), batch {len(PROMPTS)} left-padded "
          f"prompts of {', '.join(map(str, PROMPTS))} tokens, generate {args.new_tokens} "
          f"tokens; medians of {args.rounds} alternating rounds", flush=True)
    run(name)                                             # warm-up (first-call costs)
    run("sdpa")
    ours, theirs = [], []
    same_rows = len(PROMPTS)                              # sequences equal in every round
    for _ in range(args.rounds):
        t_ours, out_ours = run(name)
        t_theirs, out_theirs = run("sdpa")
        ours.append(t_ours)
        theirs.append(t_theirs)
        same_rows = min(same_rows, int((out_ours == out_theirs).all(dim=1).sum()))
    a, b = statistics.median(ours), statistics.median(theirs)
    same = same_rows == len(PROMPTS)
    verdict = ("yes" if same else f"{same_rows} of {len(PROMPTS)} sequences"
               if args.dtype != "float32" else "NO")
    print(f"  attnkit {a * 1e3:8.1f} ms   sdpa {b * 1e3:8.1f} ms   sdpa/attnkit "
          f"{b / a:5.2f}x   (target >= 0.95x; same tokens: {verdict})", flush=True)
    return 0 if same or args.dtype != "float32" else 1


if __name__ == "__main__":
    sys.exit(main())
