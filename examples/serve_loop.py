"""A tiny server loop on a paged KV cache: requests arrive over time, prefill in chunks,
decode together, finish at different times and free their pages.

    python examples/serve_loop.py

The model is a two-layer decoder built from attnkit's layers (``ak.MultiHeadAttention`` with
GQA and rotary embeddings, ``ak.RMSNorm``, a small MLP), random weights, no download. Every
step packs the active requests into one ragged batch — some in a prefill chunk, most
decoding one token — appends the new keys/values to each layer's ``ak.PagedKVCache`` and
attends with one ``ak.attention_varlen`` call per layer over the pages. Some requests share a
system prompt: its pages are computed once and ``fork``-ed (copy-on-write). Requests wait
for admission when the pool has too few free pages.

The check: every request's generated tokens equal the tokens it gets when generated alone
with a contiguous ``ak.KVCache`` (``tests/test_serve_loop_example.py`` runs this in CI).
"""

from __future__ import annotations

import dataclasses
import random

import torch
from torch import nn

import attnkit as ak

DT = torch.float64


class Block(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = ak.RMSNorm(d), ak.RMSNorm(d)
        self.attn = ak.MultiHeadAttention(d, heads, n_kv_heads=kv_heads, rope=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))


class TinyLM(nn.Module):
    """Embedding → blocks (pre-norm attention + MLP) → logits."""

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, kv_heads: int = 2,
                 layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, kv_heads) for _ in range(layers))
        self.norm = ak.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    # one request, contiguous caches (the standard layer call)
    def forward_contiguous(self, tokens: torch.Tensor, caches: list[ak.KVCache]
                           ) -> torch.Tensor:
        """tokens (N,) → logits (N, vocab), appending to one KVCache per layer."""
        x = self.embed(tokens)[None]                                  # (1, N, d)
        for blk, cache in zip(self.blocks, caches, strict=True):
            x = x + blk.attn(blk.norm1(x), cache=cache, is_causal=True)
            x = x + blk.mlp(blk.norm2(x))
        return self.head(self.norm(x))[0]

    # a ragged batch, paged caches
    def forward_paged(self, tokens: torch.Tensor, seqs: list[int], n_new: list[int],
                      caches: list[ak.PagedKVCache]) -> torch.Tensor:
        """tokens (total,) packed: sequence b's ``n_new[b]`` new tokens, one after another →
        logits (total, vocab). Appends to every layer's cache and attends through its pages."""
        starts = [caches[0].length(s) for s in seqs]                  # cached before
        positions = torch.cat([torch.arange(p, p + n) for p, n in zip(starts, n_new,
                                                                      strict=True)])
        cu_q = torch.tensor([0, *torch.tensor(n_new).cumsum(0).tolist()], dtype=torch.int32)
        x = self.embed(tokens)[None]                                  # (1, total, d)
        for blk, cache in zip(self.blocks, caches, strict=True):
            a = blk.attn
            h = blk.norm1(x)
            q, k, v = a.project_q(h), a.project_k(h), a.project_v(h)  # (1, H|H_kv, total, D)
            q, k = a.rotate_qk(q, k, positions, None)
            q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))       # (total, H|H_kv, D)
            for b, s in enumerate(seqs):                              # append each chunk
                cache.append(s, k[cu_q[b]: cu_q[b + 1]], v[cu_q[b]: cu_q[b + 1]])
            lens = cache.seqlens(seqs)
            cu_k = torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(torch.int32)
            o = ak.attention_varlen(q, cache.k_pages, cache.v_pages, cu_q, cu_k,
                                    block_table=cache.block_table(seqs), causal=True,
                                    softmax_scale=a.scale)           # (total, H, D)
            x = x + a.out_proj(o.flatten(1)[None])
            x = x + blk.mlp(blk.norm2(x))
        return self.head(self.norm(x))[0]


@dataclasses.dataclass
class Request:
    rid: int
    arrival: int                 # the step it arrives at
    prompt: list[int]            # its own tokens (after the shared system prompt, if any)
    max_new: int
    shared_prefix: bool = False
    seq: int | None = None       # its sequence id in every layer's cache (they agree)
    fed: int = 0                 # prompt tokens already prefilled
    out: list[int] = dataclasses.field(default_factory=list)


def total_len(r: Request, system: list[int]) -> int:
    """Tokens a request's sequence holds when it is done."""
    return len(r.prompt) + r.max_new + (len(system) if r.shared_prefix else 0)


def make_requests(n: int, seed: int, vocab: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request(i, arrival=rng.randint(0, 6),
                    prompt=[rng.randrange(vocab) for _ in range(rng.randint(1, 23))],
                    max_new=rng.randint(1, 9), shared_prefix=rng.random() < 0.5)
            for i in range(n)]


def generate_alone(model: TinyLM, prompt: list[int], max_new: int) -> list[int]:
    """Greedy tokens of one request with contiguous caches."""
    caches = [ak.KVCache() for _ in model.blocks]
    logits = model.forward_contiguous(torch.tensor(prompt), caches)
    out = [int(logits[-1].argmax())]
    while len(out) < max_new:
        logits = model.forward_contiguous(torch.tensor(out[-1:]), caches)
        out.append(int(logits[-1].argmax()))
    return out


def serve(model: TinyLM, requests: list[Request], system: list[int], *, num_blocks: int = 32,
          block_size: int = 4, chunk: int = 5, max_batch: int = 6, log: bool = False
          ) -> dict[int, list[int]]:
    """Run the loop until every request is done → {rid: generated tokens}."""
    a0 = model.blocks[0].attn
    caches = [ak.PagedKVCache(num_blocks, block_size, a0.n_kv_heads, a0.head_dim, dtype=DT)
              for _ in model.blocks]
    root = [c.new_sequence() for c in caches]                         # the system prompt,
    model.forward_paged(torch.tensor(system), root[:1], [len(system)], caches)   # once
    waiting = sorted(requests, key=lambda r: r.arrival)
    active: list[Request] = []
    done: dict[int, list[int]] = {}
    step = 0
    while waiting or active:
        # admit arrived requests while the pool can hold their whole future
        while waiting and waiting[0].arrival <= step and len(active) < max_batch:
            r = waiting[0]
            # pages still to come: each request's whole length, + 1 for a copy-on-write
            future = sum(max(0, -(-total_len(a, system) // block_size) + 1
                             - len(caches[0].pages(a.seq))) for a in active)
            if -(-total_len(r, system) // block_size) + 1 + future > caches[0].num_free_blocks:
                break                                                 # wait for pages
            waiting.pop(0)
            ids = [c.fork(s) if r.shared_prefix else c.new_sequence()
                   for c, s in zip(caches, root, strict=True)]
            assert len(set(ids)) == 1
            r.seq = ids[0]
            active.append(r)
            if log:
                print(f"step {step:2d}: admit request {r.rid} (prompt {len(r.prompt)}"
                      f"{' + shared prefix' if r.shared_prefix else ''}, {r.max_new} new)")
        if not active:
            if waiting and waiting[0].arrival <= step:
                raise RuntimeError(f"request {waiting[0].rid} needs more pages than the pool "
                                   f"has ({num_blocks} of {block_size} tokens)")
            step += 1
            continue
        # one ragged batch: a prefill chunk for requests still in their prompt, else 1 token
        feed = []
        for r in active:
            if r.fed < len(r.prompt):
                feed.append(r.prompt[r.fed: r.fed + chunk])
            else:
                feed.append(r.out[-1:])
        tokens = torch.tensor([t for f in feed for t in f])
        n_new = [len(f) for f in feed]
        logits = model.forward_paged(tokens, [r.seq for r in active], n_new, caches)
        last = torch.tensor(n_new).cumsum(0) - 1
        for r, f, i in zip(active, feed, last.tolist(), strict=True):
            if r.fed < len(r.prompt):
                r.fed += len(f)
                if r.fed < len(r.prompt):
                    continue                                          # more prompt to go
            r.out.append(int(logits[i].argmax()))
        for r in [r for r in active if len(r.out) == r.max_new]:
            for c in caches:
                c.free(r.seq)
            active.remove(r)
            done[r.rid] = r.out
            if log:
                print(f"step {step:2d}: request {r.rid} done, {caches[0].num_free_blocks} "
                      "pages free")
        step += 1
    return done


def main() -> None:
    torch.manual_seed(0)
    model = TinyLM().to(DT).eval()
    vocab = model.embed.num_embeddings
    system = [random.Random(1).randrange(vocab) for _ in range(9)]
    requests = make_requests(10, seed=0, vocab=vocab)
    with torch.no_grad():
        got = serve(model, requests, system, log=True)
        for r in requests:
            alone = generate_alone(model, (system if r.shared_prefix else []) + r.prompt,
                                   r.max_new)
            assert got[r.rid] == alone, (r.rid, got[r.rid], alone)
    print(f"all {len(requests)} requests equal their tokens generated alone with a "
          "contiguous KVCache")


if __name__ == "__main__":
    main()
