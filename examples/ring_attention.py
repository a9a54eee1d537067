"""Ring attention across processes: each rank holds a slice of one long sequence.

    torchrun --nproc-per-node 2 examples/ring_attention.py     # gloo on CPU, 2 ranks
    python examples/ring_attention.py                          # one process (a group of 1)

The ranks form a ``DeviceMesh`` with a data-parallel and a context-parallel dimension
(``dp`` × ``cp``, here 1 × world size); ring attention runs over the ``cp`` dimension's
process group, as it would inside a larger job. Every rank builds the same global q, k, v
(a seeded generator: in a model each rank embeds its own tokens), keeps its zig-zag shard,
rotates it by its global positions (RoPE), and runs causal attention forward and backward,
then a sliding window. Rank 0 prints the largest difference from single-process attention
on the whole sequence, outputs and gradients.

Shape legend: q, k, v (B, H, N, D) global; a rank's shard (B, H, N / W, D).
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import attnkit as ak
import attnkit.distributed as akd


def main(group: dist.ProcessGroup | None = None, n: int = 512) -> float:
    """Ring attention over ``group`` (default: the ``cp`` dim of a 1 × W mesh) vs single
    process; returns the largest difference (outputs and q/k/v gradients, float64)."""
    if group is None:
        mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "cp"))
        group = mesh["cp"].get_group()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, n, 32, generator=g, dtype=torch.float64) for _ in range(3))
    rope = ak.rope.RoPE()
    pos = akd.sequence_positions(n, group=group, layout="zigzag")      # this shard's positions
    worst = 0.0
    for opts in ({"is_causal": True}, {"mask": ak.masks.sliding_window(64)}):
        shards = [akd.shard_sequence(t, group=group, layout="zigzag").requires_grad_()
                  for t in (q, k, v)]
        qs, ks, vs = shards
        out = akd.ring_attention(rope(qs, positions=pos), rope(ks, positions=pos), vs,
                                 group=group, layout="zigzag", **opts)
        out.square().sum().backward()

        full = [t.clone().requires_grad_() for t in (q, k, v)]        # the same, one process
        want = ak.attention(rope(full[0]), rope(full[1]), full[2], backend="reference", **opts)
        want.square().sum().backward()
        for got, ref in zip([out] + [t.grad for t in shards],
                            [want] + [t.grad for t in full], strict=True):
            mine = akd.shard_sequence(ref.detach(), group=group, layout="zigzag")
            worst = max(worst, (got.detach() - mine).abs().max().item())
    err = torch.tensor([worst], dtype=torch.float64)
    dist.all_reduce(err, op=dist.ReduceOp.MAX, group=group)
    return err.item()


if __name__ == "__main__":
    torch.set_num_threads(1)
    if "RANK" in os.environ:        # started by torchrun: one process per rank
        dist.init_process_group("gloo")
    else:                           # run as it is: a group of one
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/rendezvous",
                                rank=0, world_size=1)
    err = main()
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} rank(s), N=512, causal and sliding window(64), "
              f"zig-zag shards: max |ring − single process| = {err:.1e} (outputs and "
              "gradients, float64)")
    dist.destroy_process_group()
