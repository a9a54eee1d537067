"""Ring attention over torch.distributed (gloo, CPU), checked against single-process attention.

Starting processes is the slow part, so both worlds (2 and 3 ranks) are started once per
module, together, forked from a forkserver that imported torch once; every worker runs all
cases and reports per case, and the tests below read those reports. Each case builds the global
sequence from a seeded generator (the same on every rank), runs ``ring_attention`` on this
rank's shard and compares output, LSE and the q/k/v gradients with the float64 reference
``attnkit.attention(..., backend="reference")`` on the concatenated sequence.

Shape legend: q (B, H_q, W·N_q, D_k), k (B, H_kv, W·N_k, D_k), v (B, H_kv, W·N_k, D_v) global;
rank r holds rows [r·N, (r+1)·N) of the sequence dim.
"""

from __future__ import annotations

import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import attnkit as ak
from attnkit import distributed as akd
from attnkit.backends.base import Backend, Problem, merge_partials
from attnkit.distributed import collectives as akd_c
from attnkit.distributed import ring as akd_ring

JOIN_TIMEOUT_S = 90         # a hung collective fails the run instead of hanging CI
COLLECTIVE_TIMEOUT_S = 30   # gloo gives up on a lost peer after this


# ----------------------------------------------------------------------- case machinery
def _global_inputs(seed: int, lead: tuple[int, ...], h_q: int, h_kv: int, n_q: int,
                   n_k: int, d_k: int, d_v: int) -> tuple[torch.Tensor, ...]:
    """Global float64 q, k, v, dO, dLSE (identical on every rank: a seeded generator)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return (r(*lead, h_q, n_q, d_k), r(*lead, h_kv, n_k, d_k), r(*lead, h_kv, n_k, d_v),
            r(*lead, h_q, n_q, d_v), r(*lead, h_q, n_q))


def _shard(t: torch.Tensor, rank: int, world: int, dim: int) -> torch.Tensor:
    n = t.shape[dim] // world
    return t.narrow(dim, rank * n, n).clone()


def _non_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values as a strided view: (..., H, N, D) stored as (..., N, H, D)."""
    return t.transpose(-3, -2).contiguous().transpose(-3, -2)


def _single(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_out: torch.Tensor,
            d_lse: torch.Tensor | None, **opts: object) -> list[torch.Tensor]:
    """[out, lse, dq, dk, dv] of single-process reference attention on the whole sequence."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = ak.attention(q, k, v, backend="reference", return_lse=True, **opts)
    loss = (out.double() * d_out).sum()
    if d_lse is not None:
        loss = loss + (lse.double() * d_lse).sum()
    loss.backward()
    return [out, lse, q.grad, k.grad, v.grad]


def _compare(*, rank: int, world: int, seed: int = 0, lead: tuple[int, ...] = (2,),
             h_q: int = 2, h_kv: int = 2, n_q: int = 5, n_k: int | None = None, d_k: int = 8,
             d_v: int | None = None, is_causal: bool = False, scale: float | None = None,
             softcap: float | None = None, dtype: torch.dtype = torch.float64,
             with_lse_grad: bool = False, backend: str = "auto", group: object = None,
             two_d: bool = False, non_contiguous: bool = False,
             ranks: list[int] | None = None, atol: float = 1e-10,
             layout: str = "contiguous", strategy: str = "ring", mask: object = None,
             score_mod: object = None, extra_leaves: tuple[torch.Tensor, ...] = ()) -> None:
    """Ring attention on this rank's shard vs the float64 reference on the whole sequence.

    float64: every result within ``atol``. Lower precision (the testing rule of DESIGN.md):
    the error against the float64 oracle is at most 2× (gradients 3×) the error of the
    reference run single-process in that same dtype, plus 1e-6 (a few float32 ulps at these
    magnitudes: a float32 ring sums W partial gradients, the reference sums once).
    """
    ranks = ranks if ranks is not None else list(range(world))
    w, r = len(ranks), ranks.index(rank)
    n_k = n_q if n_k is None else n_k
    d_v = d_k if d_v is None else d_v
    q, k, v, d_out, d_lse = _global_inputs(seed, lead, h_q, h_kv, w * n_q, w * n_k, d_k, d_v)
    if two_d:   # plain (N, D) inputs: one head, no batch
        q, k, v, d_out, d_lse = q[0], k[0], v[0], d_out[0], d_lse[0]
    seq = -2

    def _shard(t: torch.Tensor, rank: int, world: int, dim: int) -> torch.Tensor:
        return akd.shard_sequence(t, rank, world, layout=layout, dim=dim)

    qs, ks, vs = (_shard(t, r, w, seq).to(dtype) for t in (q, k, v))
    if non_contiguous:
        qs, ks, vs = (_non_contiguous(t) for t in (qs, ks, vs))
        assert not qs.is_contiguous()
    qs, ks, vs = (t.requires_grad_() for t in (qs, ks, vs))
    extra = {"layout": layout} if layout != "contiguous" else {}
    if strategy != "ring":
        extra["strategy"] = strategy
    if mask is not None:
        extra["mask"] = mask
    if score_mod is not None:
        extra["score_mod"] = score_mod
    out, lse = akd.ring_attention(qs, ks, vs, group=group, is_causal=is_causal, scale=scale,
                                  softcap=softcap, backend=backend, return_lse=True, **extra)
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64
                                                else torch.float32)
    loss = (out.double() * _shard(d_out, r, w, seq)).sum()
    if with_lse_grad:
        loss = loss + (lse.double() * _shard(d_lse, r, w, -1)).sum()
    loss.backward()
    got = [out, lse, qs.grad, ks.grad, vs.grad]
    got_extra = [t.grad.clone() for t in extra_leaves]     # e.g. a relative-bias table
    for t in extra_leaves:
        t.grad = None

    opts = {"is_causal": is_causal, "scale": scale, "softcap": softcap, "mask": mask,
            "score_mod": score_mod}
    d_l = d_lse if with_lse_grad else None
    dims = [seq, -1, seq, seq, seq]
    want = [_shard(t, r, w, dim) for t, dim in
            zip(_single(q, k, v, d_out, d_l, **opts), dims, strict=True)]
    if dtype == torch.float64:
        tols = [atol] * 5
    else:   # the same reference, in the same low precision: its error sets the bar
        low = _single(q.to(dtype), k.to(dtype), v.to(dtype), d_out, d_l, **opts)
        tols = [f * _max_err(_shard(t, r, w, dim), ref) + 1e-6
                for f, t, dim, ref in zip((2, 2, 3, 3, 3), low, dims, want, strict=True)]
    for name, g, ref, tol in zip(("out", "lse", "dq", "dk", "dv"), got, want, tols,
                                 strict=True):
        assert g is not None, f"{name} is missing"
        assert g.shape == ref.shape, f"{name}: shape {tuple(g.shape)} != {tuple(ref.shape)}"
        assert not g.isnan().any(), f"{name} has NaN"
        err = _max_err(g, ref)
        assert err <= tol, f"rank {rank}: {name} differs by {err:.3g} (allowed {tol:.3g})"
    if extra_leaves:    # parameters shared by every rank: their gradients summed over ranks
        sums = [g.clone() for g in got_extra]
        for g in sums:
            dist.all_reduce(g, group=group)
        want_extra = [t.grad for t in extra_leaves]      # from _single's backward
        for g, ref in zip(sums, want_extra, strict=True):
            err = _max_err(g, ref)
            assert err <= atol, f"rank {rank}: a parameter's gradient differs by {err:.3g}"


def _max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got − want| (0 for empty tensors; equal infinities, e.g. LSE −∞, count as 0)."""
    got, want = got.detach().double(), want.detach().double()
    diff = torch.where(got == want, torch.zeros_like(got), got - want).abs()
    return diff.max().item() if diff.numel() else 0.0


def _assert_close(got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
    """Max-abs comparison (torch.testing.assert_close would import DTensor and sympy: seconds)."""
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = _max_err(got, want)
    assert err <= atol, f"differs by {err:.3g} (atol {atol:.1g})"


def _expect_error(fn: Callable[[], object], exc: type[Exception], text: str) -> None:
    try:
        fn()
    except exc as e:
        assert text in str(e), f"expected {text!r} in the message, got: {e}"
        return
    raise AssertionError(f"expected {exc.__name__} containing {text!r}, nothing was raised")


def _case_mismatched_lengths(rank: int, world: int) -> None:
    n = 5 + (rank == 1)     # rank 1 holds one position more
    q, k, v = (torch.randn(1, 2, n, 4) for _ in range(3))
    # every rank sees the mismatch (not only rank 1), so no rank is left waiting
    _expect_error(lambda: akd.ring_attention(q, k, v), ValueError, "same shard shapes")
    # and the message lists each rank's shapes
    _expect_error(lambda: akd.ring_attention(q, k, v), ValueError, "rank 1: q (1, 2, 6, 4)")
    # a difference in the leading (batch) dims is caught too
    q7, k7, v7 = (torch.randn(2 + (rank == 0), 1, 1, 1, 2, 5, 4) for _ in range(3))
    _expect_error(lambda: akd.ring_attention(q7, k7, v7), ValueError, "rank 0: q (…, 1, 1, 1")
    _expect_error(lambda: akd.ring_attention(q, k, v, backend="nope"), ValueError,
                  "unknown backend 'nope'")


def _case_local_error_reaches_peers(rank: int, world: int) -> None:
    q = torch.randn(1, 2, 5, 4)
    k = torch.randn(1, 2, 5, 4 if rank != 0 else 3)    # rank 0: D_k mismatch
    v = torch.randn(1, 2, 5, 4)
    if rank == 0:
        _expect_error(lambda: akd.ring_attention(q, k, v), ValueError, "feature width D_k")
    else:
        _expect_error(lambda: akd.ring_attention(q, k, v), RuntimeError, "rank(s) [0]")


def _case_causal_needs_equal_shards(rank: int, world: int) -> None:
    q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 4)
    _expect_error(lambda: akd.ring_attention(q, k, v, is_causal=True), ValueError,
                  "N_q=3")


def _case_options_must_agree(rank: int, world: int) -> None:
    q, k, v = (torch.randn(1, 2, 4, 4) for _ in range(3))
    _expect_error(lambda: akd.ring_attention(q, k, v, is_causal=rank == 0), ValueError,
                  "is_causal=True")


def _case_subgroup(rank: int, world: int) -> None:
    members = [1, 2]
    group = dist.new_group(members)     # every rank must create the group
    if rank in members:
        _compare(rank=rank, world=world, is_causal=True, n_q=6, group=group, ranks=members)
        _compare(rank=rank, world=world, is_causal=True, n_q=6, group=group, ranks=members,
                 layout="zigzag", h_q=4, h_kv=2)
        _compare(rank=rank, world=world, is_causal=True, n_q=6, group=group, ranks=members,
                 layout="zigzag", strategy="ulysses", h_q=4, h_kv=1, with_lse_grad=True)
    else:
        _expect_error(lambda: akd.ring_attention(*(torch.randn(1, 4, 4) for _ in range(3)),
                                                 group=group),
                      RuntimeError, "not a member")


def _case_device_mesh(rank: int, world: int) -> None:
    """The context-parallel dimension of a DeviceMesh that leaves rank 0 out (a 1 × 2 mesh
    of ranks 1 and 2, dims dp × cp): its group, as a larger job would pass it."""
    from torch.distributed.device_mesh import DeviceMesh

    members = [1, 2]
    mesh = DeviceMesh("cpu", torch.tensor([members]), mesh_dim_names=("dp", "cp"))  # all call
    if rank in members:
        group = mesh["cp"].get_group()
        _compare(rank=rank, world=world, n_q=6, group=group, ranks=members, layout="zigzag",
                 mask=ak.masks.sliding_window(4), h_q=2, h_kv=1)


def _case_example(rank: int, world: int) -> None:
    """examples/ring_attention.py's main() on this world: a DeviceMesh's cp group, RoPE,
    zig-zag, causal and a sliding window, forward and backward."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "examples", "ring_attention.py")
    spec = importlib.util.spec_from_file_location("ring_attention_example", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    err = example.main(n=8 * world)
    assert err < 1e-12, err


def _case_every_backend(rank: int, world: int) -> None:
    """Each registered backend that can run a ring block gives the same gradients."""
    tried = []
    for name in ak.backends.names():
        # a training block: q, k, v require grad (forward-only backends decline it)
        block = Problem(*(torch.randn(1, 4 // h, 9, 8, dtype=torch.float64, requires_grad=True)
                          for h in (1, 2, 2)), mask=ak.masks.causal(), softcap=3.0)
        if ak.backends.get(name).not_supported_reasons(block):
            continue
        for causal, softcap in ((False, None), (True, None), (True, 3.0)):
            _compare(rank=rank, world=world, n_q=9, h_q=4, h_kv=2, is_causal=causal,
                     softcap=softcap, backend=name, with_lse_grad=True)
        tried.append(name)
    assert "reference" in tried, tried


def _case_causal_skips_future_blocks(rank: int, world: int) -> None:
    """Causal: rank r computes blocks 0..r only (r + 1 attention calls each way); no skipping
    without the mask."""
    calls: list[tuple[int, bool]] = []
    real = akd_ring.attention

    def counting(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> object:
        calls.append((k.shape[-2], bool(kw["is_causal"])))
        return real(q, k, v, **kw)

    akd_ring.attention = counting
    try:
        for causal in (True, False):
            calls.clear()
            q, k, v = (torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True)
                       for _ in range(3))
            out = akd.ring_attention(q, k, v, is_causal=causal, backend="reference")
            n_fwd = len(calls)
            out.sum().backward()
            want = rank + 1 if causal else world
            assert n_fwd == want and len(calls) == 2 * want, (causal, n_fwd, len(calls))
            # only the diagonal block is masked, once each way
            assert sum(c for _, c in calls) == (2 if causal else 0), calls
    finally:
        akd_ring.attention = real


class _DetachedLse(Backend):
    """The reference with an LSE that carries no gradient (as fused kernels often return)."""

    name = "test_detached_lse"

    def not_supported_reasons(self, p: Problem) -> list[str]:
        return []

    def forward(self, p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = ak.backends.get("reference").forward(p)
        return out, lse.detach()


def _case_backend_lse_without_grad(rank: int, world: int) -> None:
    """Blocks whose LSE has no gradient: the LSE's share of the gradient is added by hand
    (one more attention call with K as values), or, with softcap, the reference is used."""
    ak.backends.register(_DetachedLse())
    ak.backends.PRIORITY.remove(_DetachedLse.name)      # forced only, never picked by "auto"
    try:
        for causal, softcap in ((True, None), (False, None), (True, 2.0)):
            _compare(rank=rank, world=world, n_q=6, h_q=4, h_kv=2, d_v=5, is_causal=causal,
                     softcap=softcap, scale=0.4, backend=_DetachedLse.name, with_lse_grad=True)
    finally:
        del ak.backends.REGISTRY[_DetachedLse.name]


def _same_error_everywhere(fn: Callable[[], object], exc: type[Exception],
                           *texts: str) -> None:
    """``fn`` raises ``exc`` on this rank with every one of ``texts`` in the message, and every
    rank of the world raised the very same message."""
    try:
        fn()
    except exc as e:
        msg = str(e)
    else:
        msg = f"nothing was raised (expected {exc.__name__})"
    msgs: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(msgs, msg)
    for t in texts:
        assert t in msg, f"expected {t!r} in the message, got: {msg}"
    assert all(m == msg for m in msgs), f"the ranks raised different errors: {msgs}"


def _case_options_differ(rank: int, world: int) -> None:
    """scale, softcap, backend, whether a backward is needed, leading dims: a difference raises
    the same ValueError on every rank, naming the option and each rank's value."""
    q, k, v = (torch.randn(1, 2, 4, 4) for _ in range(3))
    first = rank == 0
    _same_error_everywhere(lambda: akd.ring_attention(q, k, v, scale=0.5 if first else 0.25),
                           ValueError, "scale: rank 0: scale=0.5; rank 1: scale=0.25")
    _same_error_everywhere(lambda: akd.ring_attention(q, k, v, softcap=None if first else 5.0),
                           ValueError, "softcap: rank 0: softcap=None; rank 1: softcap=5.0")
    _same_error_everywhere(
        lambda: akd.ring_attention(q, k, v, backend="reference" if first else "tiled"),
        ValueError, "backend: rank 0: backend='reference'; rank 1: backend='tiled'")
    qg = q.clone().requires_grad_(first)    # rank 0 would run a backward its peers never join
    _same_error_everywhere(lambda: akd.ring_attention(qg, k, v), ValueError,
                           "needs a backward: rank 0: inputs require grad; rank 1: no input")
    lead = (2, 3) if first else (3, 2)      # same numel and trailing dims, other leading dims
    q8, k8, v8 = (torch.randn(*lead, 1, 1, 1, 2, 3, 4) for _ in range(3))
    _same_error_everywhere(lambda: akd.ring_attention(q8, k8, v8), ValueError,
                           "same shard shapes", "after leading dims (2, 3)")
    # a shard on another device type (here "meta", standing in for a forgotten .cuda())
    qm, km, vm = (torch.randn(1, 2, 4, 4, device="meta" if first else "cpu") for _ in range(3))
    _same_error_everywhere(lambda: akd.ring_attention(qm, km, vm, timeout=5), ValueError,
                           "device type: rank 0: 'meta'; rank 1: 'cpu'")
    # the resolved scale is what must agree: None (1/√4) on one rank, 0.5 on the others
    out = akd.ring_attention(q, k, v, scale=None if first else 0.5)
    assert out.shape == q.shape


def _case_forward_only_backend_refused(rank: int, world: int) -> None:
    """A forced backend that cannot run the backward (decode, forward only) or the forward
    (decode with N_q > 16) is refused on every rank before any shard moves."""
    hops: list[object] = []
    real = akd_c._Ring.exchange

    def counting(self: object, *a: object, **kw: object) -> object:
        hops.append(a)
        return real(self, *a, **kw)   # type: ignore[arg-type]

    akd_c._Ring.exchange = counting     # type: ignore[method-assign]
    try:
        q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
        _same_error_everywhere(lambda: akd.ring_attention(q, k, v, backend="decode"),
                               ValueError, "backend 'decode' cannot run", "forward only",
                               "[backward]", "torch.no_grad()")
        long = torch.randn(1, 2, 20, 8)
        _same_error_everywhere(lambda: akd.ring_attention(long, long, long, backend="decode",
                                                          is_causal=True),
                               ValueError, "at most 16 queries", "[forward]")
        assert not hops, f"{len(hops)} shard(s) moved before the refusal"
    finally:
        akd_c._Ring.exchange = real     # type: ignore[method-assign]
    # without gradients the decode backend still runs the ring, and matches the reference
    qg, kg, vg, _, _ = _global_inputs(3, (1,), 2, 2, world * 3, world * 3, 8, 8)
    shards = [_shard(t, rank, world, -2).float() for t in (qg, kg, vg)]
    with torch.no_grad():
        out = akd.ring_attention(*shards, backend="decode", is_causal=True)
    want = ak.attention(qg, kg, vg, is_causal=True, backend="reference")
    _assert_close(out, _shard(want, rank, world, -2), 1e-5)


def _case_timeout_is_checked(rank: int, world: int) -> None:
    q = torch.randn(1, 2, 4, 4)
    for bad, exc in ((0, ValueError), (-1.0, ValueError), (float("inf"), ValueError),
                     ("5", TypeError), (True, TypeError)):
        _same_error_everywhere(lambda b=bad: akd.ring_attention(q, q, q, timeout=b), exc,
                               "timeout must be")
    assert akd.ring_attention(q, q, q, timeout=None).shape == q.shape
    assert akd.ring_attention(q, q, q, timeout=7.5).shape == q.shape


def _case_kernel_backward(rank: int, world: int) -> None:
    """backend 'auto' on the native kernel: each backward block is ONE call of the kernel's
    own backward with the saved global LSE (no recompute under autograd), equal to the
    reference in float64; a forced 'reference' keeps the autograd path."""
    from attnkit.backends import native

    if not native.available():
        return
    used = [0]
    real = akd_ring._kernel_block_grads

    def counting(*a: object, **kw: object) -> object:
        used[0] += 1
        return real(*a, **kw)   # type: ignore[arg-type]

    akd_ring._kernel_block_grads = counting
    try:
        for layout in akd.LAYOUTS:
            used[0] = 0
            _compare(rank=rank, world=world, is_causal=True, layout=layout, h_q=4, h_kv=2,
                     n_q=6, softcap=2.0, with_lse_grad=True)
            assert used[0] == (world if layout == "zigzag" else rank + 1), (layout, used)
        used[0] = 0
        _compare(rank=rank, world=world, is_causal=True, n_q=4, backend="reference")
        assert used[0] == 0, used
    finally:
        akd_ring._kernel_block_grads = real


# ------------------------------------------------------- zig-zag layout and the Ulysses strategy
def _case_zigzag_balanced(rank: int, world: int) -> None:
    """Causal zig-zag: on every hop every rank computes two chunk-pairs of work — the local
    causal (2c × 2c, half of it) or 2c × c full — forward and backward alike."""
    calls: list[tuple[int, int, bool]] = []
    real = akd_ring.attention

    def counting(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> object:
        calls.append((q.shape[-2], k.shape[-2], bool(kw["is_causal"])))
        return real(q, k, v, **kw)

    akd_ring.attention = counting
    try:
        c = 3
        q, k, v = (torch.randn(1, 2, 2 * c, 8, dtype=torch.float64, requires_grad=True)
                   for _ in range(3))
        out = akd.ring_attention(q, k, v, is_causal=True, layout="zigzag", backend="reference")
        n_fwd = len(calls)
        out.sum().backward()
    finally:
        akd_ring.attention = real
    assert n_fwd == world and len(calls) == 2 * world, (n_fwd, calls)
    for n_q, n_k, causal in calls:
        assert (n_q, n_k, causal) in ((2 * c, 2 * c, True), (2 * c, c, False),
                                      (c, 2 * c, False)), calls
    assert sum(causal for *_, causal in calls) == 2, calls      # the diagonal, once each way


def _case_zigzag_helpers(rank: int, world: int) -> None:
    """shard / unshard / positions agree with each other and with the ring's layout."""
    n = 4 * world
    x = torch.arange(2 * 3 * n).reshape(2, 3, n, 1)
    for layout in akd.LAYOUTS:
        shards = [akd.shard_sequence(x, r, world, layout=layout) for r in range(world)]
        assert torch.equal(akd.unshard_sequence(shards, layout=layout), x)
        pos = akd.sequence_positions(n, layout=layout)       # this process's rank
        assert torch.equal(shards[rank][0, 0, :, 0], pos), (layout, pos)
        assert torch.equal(akd.shard_sequence(x, layout=layout), shards[rank])
    if world == 2:
        assert akd.sequence_positions(8, 0, 2, layout="zigzag").tolist() == [0, 1, 6, 7]
        assert akd.sequence_positions(8, 1, 2, layout="zigzag").tolist() == [2, 3, 4, 5]
    _expect_error(lambda: akd.shard_sequence(torch.zeros(1, 2 * world + 1, 4), layout="zigzag"),
                  ValueError, f"must be a multiple of {2 * world}")
    _expect_error(lambda: akd.sequence_positions(8, layout="spiral"), ValueError,
                  "layout must be one of")
    q = torch.randn(1, 2, 5, 4)     # odd shard: not two equal chunks
    _same_error_everywhere(lambda: akd.ring_attention(q, q, q, is_causal=True,
                                                      layout="zigzag"),
                           ValueError, "shard lengths must be even", "N_q=5")
    qe = torch.randn(1, 2, 4, 4)
    _same_error_everywhere(
        lambda: akd.ring_attention(qe, qe, qe, layout="zigzag" if rank == 0 else "contiguous"),
        ValueError, "layout: rank 0: layout='zigzag'; rank 1: layout='contiguous'")


def _case_rope_positions(rank: int, world: int) -> None:
    """RoPE with the shard's global positions, zig-zag causal ring = single-process RoPE."""
    n = 4 * world
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64) for _ in range(3))
    rope = ak.rope.RoPE()
    pos = akd.sequence_positions(n, layout="zigzag")
    qs, ks, vs = (akd.shard_sequence(t, layout="zigzag") for t in (q, k, v))
    out = akd.ring_attention(rope(qs, positions=pos), rope(ks, positions=pos), vs,
                             is_causal=True, layout="zigzag")
    want = ak.attention(rope(q), rope(k), v, is_causal=True, backend="reference")
    _assert_close(out, akd.shard_sequence(want, layout="zigzag"), 1e-12)


def _case_ulysses_refusals(rank: int, world: int) -> None:
    q = torch.randn(1, 2 * world + 1, 4, 4)
    _same_error_everywhere(lambda: akd.ring_attention(q, q, q, strategy="ulysses"),
                           ValueError, "H_q must be a multiple of", "strategy='ring'")
    qh = torch.randn(1, world, 4, 4)
    heads = ak.masks.from_fn(lambda b, h, qi, ki: h == 0)
    _same_error_everywhere(lambda: akd.ring_attention(qh, qh, qh, strategy="ulysses",
                                                      mask=heads),
                           ValueError, "depends on the head index")
    docs = ak.masks.document(torch.tensor([[0, 0, 1, 1] * world]))
    _same_error_everywhere(lambda: akd.ring_attention(qh, qh, qh, mask=docs),
                           ValueError, "strategy='ulysses'", "must be a band")
    _same_error_everywhere(lambda: akd.ring_attention(qh, qh, qh, is_causal=True,
                                                      mask=ak.masks.sliding_window(2)),
                           ValueError, "either is_causal=True or mask=")
    _same_error_everywhere(lambda: akd.ring_attention(qh, qh, qh, strategy="all"), ValueError,
                           "strategy must be one of")
    _same_error_everywhere(lambda: akd.ring_attention(qh, qh, qh, strategy="ulysses",
                                                      score_mod=ak.scores.alibi(world + 1)),
                           ValueError, f"built for {world + 1} heads")
    _same_error_everywhere(   # the local call's own checks, before anything moves
        lambda: akd.ring_attention(qh, qh, qh, strategy="ulysses", is_causal=True,
                                   mask=ak.masks.causal()),
        ValueError, "is_causal")
    _same_error_everywhere(
        lambda: akd.ring_attention(qh, qh, qh, strategy="ulysses" if rank else "ring"),
        ValueError, "strategy: rank 0: strategy='ring'; rank 1: strategy='ulysses'")


def _case_ulysses_relative_bias(rank: int, world: int) -> None:
    """A learned relative-bias table: each rank's slice of it gets its heads' gradient."""
    h = 2 * world
    table = torch.randn(h, 2 * 3 + 1, generator=torch.Generator().manual_seed(5),
                        dtype=torch.float64, requires_grad=True)   # the same on every rank
    _compare(rank=rank, world=world, strategy="ulysses", is_causal=True, h_q=h, h_kv=h,
             n_q=5, score_mod=ak.scores.relative_bias(table, 3), extra_leaves=(table,))


def _head_bias(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
               kv_idx: torch.Tensor) -> torch.Tensor:
    return score + 0.1 * h - 0.01 * (q_idx - kv_idx)


def _case_window_skips_far_shards(rank: int, world: int) -> None:
    """A causal sliding window no longer than a shard: each rank computes its own shard and
    its left neighbour's only, and the K/V of every other shard is never sent (forward and
    backward); the window reaches a shard's first rows from the previous one, exactly."""
    sent: list[tuple[str, str, int | None, int | None]] = []
    real = akd_c._Ring.exchange

    def counting(self: object, sends: object, to: int | None, like: object,
                 frm: int | None, **kw: object) -> object:
        sent.append((str(kw["step"]), str(kw["what"]), to, frm))
        return real(self, sends, to, like, frm, **kw)   # type: ignore[arg-type]

    akd_c._Ring.exchange = counting     # type: ignore[method-assign]
    try:
        _compare(rank=rank, world=world, n_q=6, h_q=4, h_kv=2, mask=ak.masks.sliding_window(4),
                 with_lse_grad=True)
    finally:
        akd_c._Ring.exchange = real     # type: ignore[method-assign]
    assert {step.split(" hop ")[1] for step, *_ in sent} <= {"0", "1"}, sent   # no hop 2..
    kv = [(step, to, frm) for step, what, to, frm in sent if what == "the K/V shard"]
    nxt = rank + 1 if rank + 1 < world else None        # rank 0 needs no wrap-around shard
    prv = rank - 1 if rank > 0 else None
    assert kv == [("forward hop 1", nxt, prv), ("backward hop 1", nxt, prv)], kv


def _case_backward_pieces(rank: int, world: int) -> None:
    """The backward's sub-blocks (forced tiny here: rows × keys of one head, or one K/V head
    group) give the same gradients, kernel and autograd paths, causal and windowed."""
    real = akd_ring._PIECE_ELEMENTS
    akd_ring._PIECE_ELEMENTS = 2 * 8 * 3        # 3 rows of (2 heads × 8) per piece
    try:
        for backend in ("auto", "reference"):
            _compare(rank=rank, world=world, layout="zigzag", is_causal=True, h_q=2, h_kv=1,
                     n_q=10, backend=backend, with_lse_grad=True)
            _compare(rank=rank, world=world, n_q=7, h_q=2, h_kv=2, backend=backend,
                     mask=ak.masks.sliding_window(5, causal=False))
        akd_ring._PIECE_ELEMENTS = 2 * 4 * 8        # one K/V head (2 query heads) per piece
        _compare(rank=rank, world=world, layout="zigzag", is_causal=True, h_q=4, h_kv=2,
                 n_q=4, with_lse_grad=True)
    finally:
        akd_ring._PIECE_ELEMENTS = real


def _case_backward_streams_kv_chunks(rank: int, world: int) -> None:
    """With sub-blocks of one K/V head, the backward receives each hop's K/V shard one
    (batch element, head) chunk at a time, in order (two chunks in flight, not two shards),
    and the gradients still equal the float64 reference; the forward moves whole shards."""
    sent: list[tuple[str, tuple[int, ...] | None]] = []
    real_exchange, real_pieces = akd_c._Ring.exchange, akd_ring._PIECE_ELEMENTS

    def counting(self: object, sends: list | None, to: int | None, like: object,
                 frm: int | None, **kw: object) -> object:
        if kw["what"] == "the K/V shard" and sends is not None and to is not None:
            sent.append((str(kw["step"]), tuple(sends[0].shape)))
        return real_exchange(self, sends, to, like, frm, **kw)   # type: ignore[arg-type]

    akd_c._Ring.exchange = counting     # type: ignore[method-assign]
    akd_ring._PIECE_ELEMENTS = 2 * 4 * 8        # one K/V head (2 query heads) per piece
    try:
        _compare(rank=rank, world=world, lead=(2,), h_q=4, h_kv=2, n_q=4, is_causal=True,
                 layout="zigzag", with_lse_grad=True)
    finally:
        akd_c._Ring.exchange = real_exchange    # type: ignore[method-assign]
        akd_ring._PIECE_ELEMENTS = real_pieces
    forward = [shape for step, shape in sent if step.startswith("forward")]
    backward = [shape for step, shape in sent if step.startswith("backward")]
    assert forward and all(shape == (2, 2, 4, 8) for shape in forward), sent
    assert len(backward) == 4 * len(forward), sent      # 2 batch elements × 2 K/V heads
    assert all(shape == (1, 1, 4, 8) for shape in backward), sent


WINDOW_CASES: dict[str, Callable[[int, int], None]] = {
    "window_skips_far_shards": _case_window_skips_far_shards,
    "window_zigzag_gqa_softcap": lambda r, w: _compare(
        rank=r, world=w, layout="zigzag", h_q=4, h_kv=2, n_q=8, d_v=5, softcap=2.0,
        mask=ak.masks.sliding_window(3), with_lse_grad=True),
    "window_wider_than_shard": lambda r, w: _compare(
        rank=r, world=w, n_q=3, mask=ak.masks.sliding_window(7), scale=0.4),
    "window_two_sided_zigzag": lambda r, w: _compare(
        rank=r, world=w, layout="zigzag", n_q=6, mask=ak.masks.sliding_window(4, causal=False)),
    "window_bottom_right_cross": lambda r, w: _compare(
        rank=r, world=w, n_q=3, n_k=5, h_q=3, h_kv=1, mask=ak.masks.window(2, 1)),
    "window_float32": lambda r, w: _compare(
        rank=r, world=w, layout="zigzag", n_q=12, mask=ak.masks.sliding_window(5),
        dtype=torch.float32),
    "window_bfloat16": lambda r, w: _compare(
        rank=r, world=w, n_q=9, h_q=2, h_kv=1, mask=ak.masks.band(-2, 4),
        dtype=torch.bfloat16, with_lse_grad=True),
    "backward_pieces": _case_backward_pieces,
    "backward_streams_kv_chunks": _case_backward_streams_kv_chunks,
}


ZIGZAG_ULYSSES_CASES: dict[str, Callable[[int, int], None]] = {
    "zigzag_causal_gqa_softcap": lambda r, w: _compare(
        rank=r, world=w, layout="zigzag", is_causal=True, h_q=4, h_kv=2, n_q=6, d_v=5,
        softcap=2.5, with_lse_grad=True),
    "zigzag_mqa_scale": lambda r, w: _compare(
        rank=r, world=w, layout="zigzag", is_causal=True, h_q=3, h_kv=1, n_q=2, scale=0.6),
    "zigzag_not_causal_cross": lambda r, w: _compare(
        rank=r, world=w, layout="zigzag", n_q=4, n_k=6, d_v=3),
    "zigzag_float32": lambda r, w: _compare(
        rank=r, world=w, layout="zigzag", is_causal=True, n_q=18, dtype=torch.float32),
    "zigzag_empty": lambda r, w: _compare(rank=r, world=w, layout="zigzag", n_q=0,
                                          is_causal=True),
    "zigzag_bfloat16": lambda r, w: _compare(
        rank=r, world=w, layout="zigzag", is_causal=True, n_q=18, h_q=4, h_kv=2,
        dtype=torch.bfloat16, with_lse_grad=True),
    "zigzag_balanced": _case_zigzag_balanced,
    "kernel_backward": _case_kernel_backward,
    "zigzag_helpers": _case_zigzag_helpers,
    "rope_positions": _case_rope_positions,
    "ulysses_plain": lambda r, w: _compare(rank=r, world=w, strategy="ulysses", h_q=6,
                                           h_kv=6, n_q=5),
    "ulysses_causal_gqa_lse": lambda r, w: _compare(
        rank=r, world=w, strategy="ulysses", is_causal=True, h_q=6, h_kv=3, n_q=7, d_v=5,
        with_lse_grad=True),
    "ulysses_mqa_softcap_zigzag": lambda r, w: _compare(
        rank=r, world=w, strategy="ulysses", layout="zigzag", is_causal=True, h_q=6, h_kv=1,
        n_q=4, softcap=2.0, scale=0.5, with_lse_grad=True),
    "ulysses_alibi": lambda r, w: _compare(
        rank=r, world=w, strategy="ulysses", layout="zigzag", is_causal=True, h_q=6, h_kv=2,
        n_q=6, score_mod=ak.scores.alibi(6)),
    "ulysses_window_cross_lead": lambda r, w: _compare(
        rank=r, world=w, strategy="ulysses", lead=(2, 1), h_q=6, h_kv=3, n_q=3, n_k=5,
        mask=ak.masks.sliding_window(4)),
    "ulysses_head_score_mod": lambda r, w: _compare(
        rank=r, world=w, strategy="ulysses", is_causal=True, h_q=6, h_kv=6, n_q=3,
        score_mod=_head_bias),
    "ulysses_bfloat16": lambda r, w: _compare(
        rank=r, world=w, strategy="ulysses", is_causal=True, h_q=6, h_kv=3, n_q=9,
        dtype=torch.bfloat16, with_lse_grad=True),
    "ulysses_relative_bias": _case_ulysses_relative_bias,
    "ulysses_refusals": _case_ulysses_refusals,
    "ulysses_empty": lambda r, w: _compare(rank=r, world=w, strategy="ulysses", h_q=6,
                                           n_q=0, is_causal=True),
}


CASES: dict[str, Callable[[int, int], None]] = {
    "plain": lambda r, w: _compare(rank=r, world=w),
    "causal": lambda r, w: _compare(rank=r, world=w, is_causal=True),
    "causal_gqa_n17": lambda r, w: _compare(rank=r, world=w, is_causal=True, h_q=4, h_kv=2,
                                            n_q=17, d_k=8, d_v=6),
    "mqa_n1": lambda r, w: _compare(rank=r, world=w, h_q=3, h_kv=1, n_q=1, is_causal=True),
    "cross_nq_ne_nk": lambda r, w: _compare(rank=r, world=w, n_q=4, n_k=7, d_v=3),
    "scale_softcap": lambda r, w: _compare(rank=r, world=w, is_causal=True, scale=0.7,
                                           softcap=2.5),
    "lse_grad": lambda r, w: _compare(rank=r, world=w, is_causal=True, with_lse_grad=True,
                                      n_q=7),
    "two_d": lambda r, w: _compare(rank=r, world=w, lead=(), h_q=1, h_kv=1, n_q=6,
                                   is_causal=True, two_d=True),
    "batch_dims": lambda r, w: _compare(rank=r, world=w, lead=(2, 3), h_q=2, h_kv=1, n_q=3),
    "float32": lambda r, w: _compare(rank=r, world=w, is_causal=True, n_q=17,
                                     dtype=torch.float32),
    "bfloat16": lambda r, w: _compare(rank=r, world=w, is_causal=True, n_q=17, h_q=4, h_kv=2,
                                      dtype=torch.bfloat16, with_lse_grad=True),
    "float16_softcap": lambda r, w: _compare(rank=r, world=w, n_q=9, softcap=3.0,
                                             dtype=torch.float16),
    "empty_shards": lambda r, w: _compare(rank=r, world=w, n_q=0, is_causal=True),
    "empty_kv_shards": lambda r, w: _compare(rank=r, world=w, n_q=3, n_k=0),
    "non_contiguous": lambda r, w: _compare(rank=r, world=w, is_causal=True, h_q=4, h_kv=2,
                                            n_q=6, non_contiguous=True),
    "every_backend": _case_every_backend,
    "backend_lse_without_grad": _case_backend_lse_without_grad,
    "causal_skips_future_blocks": _case_causal_skips_future_blocks,
    "mismatched_lengths": _case_mismatched_lengths,
    "local_error_reaches_peers": _case_local_error_reaches_peers,
    "causal_needs_equal_shards": _case_causal_needs_equal_shards,
    "options_must_agree": _case_options_must_agree,
    "options_differ": _case_options_differ,
    "forward_only_backend_refused": _case_forward_only_backend_refused,
    "timeout_is_checked": _case_timeout_is_checked,
    **ZIGZAG_ULYSSES_CASES,
    **WINDOW_CASES,
}
WORLD_ONLY = {"subgroup": 3, "device_mesh": 3, "example": 2}   # cases for one world size
ALL_CASES = {**CASES, "subgroup": _case_subgroup, "device_mesh": _case_device_mesh,
             "example": _case_example}


def _worker(rank: int, world: int, init_file: str, names: list[str], results: object) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    report: dict[str, str | None] = {}
    try:
        for name in names:
            try:
                ALL_CASES[name](rank, world)
                report[name] = None
            except Exception:
                report[name] = traceback.format_exc()
            dist.barrier()      # a failing case must not desynchronise the next one
    finally:
        results.put((world, rank, report))   # type: ignore[attr-defined]
        dist.destroy_process_group()


def _context() -> mp.context.BaseContext:
    """forkserver (one clean server imports torch once, workers fork from it) where the
    platform has it, else spawn (every worker imports torch itself)."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        # torch._dynamo: torch.utils.checkpoint (used by the tiled backend) imports it on first
        # use, seconds per process; importing it once in the server saves that in every worker
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "attnkit"])
        return ctx
    return mp.get_context("spawn")


def _launch(worlds: dict[int, list[str]]) -> dict[int, dict[str, list[str]]]:
    """Run each world's cases on that many gloo processes, all worlds at once.

    Returns {world: {case: [per-rank failure tracebacks]}}; fails the test run if a worker
    does not report within JOIN_TIMEOUT_S (a hung collective) or crashes.
    """
    ctx = _context()
    results = ctx.Queue()
    procs: dict[tuple[int, int], mp.process.BaseProcess] = {}
    reports: dict[tuple[int, int], dict[str, str | None]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world, names in worlds.items():
            init_file = os.path.join(tmp, f"rendezvous-{world}")
            for r in range(world):
                procs[world, r] = ctx.Process(target=_worker,
                                              args=(r, world, init_file, names, results))
        for p in procs.values():
            p.start()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while len(reports) < len(procs) and time.monotonic() < deadline:
            try:
                world, rank, rep = results.get(timeout=1.0)
                reports[world, rank] = rep
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs.values()):
                    break
        for p in procs.values():
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
    missing = sorted(set(procs) - set(reports))
    if missing:
        codes = {f"{w}/{r}": p.exitcode for (w, r), p in procs.items()}
        pytest.fail(f"ring attention workers (world/rank) {missing} did not report within "
                    f"{JOIN_TIMEOUT_S} s (exit codes {codes}): a collective hung or a worker "
                    "crashed")
    return {world: {n: [f"rank {r}:\n{reports[world, r][n]}" for r in range(world)
                        if reports[world, r].get(n)] for n in names}
            for world, names in worlds.items()}


@pytest.fixture(scope="module")
def runs() -> dict[int, dict[str, list[str]]]:
    return _launch({world: [n for n in ALL_CASES if WORLD_ONLY.get(n, world) == world]
                    for world in (2, 3)})


# ----------------------------------------------------------------------------- tests
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_ring_matches_single_process(runs: dict, world: int, case: str) -> None:
    failures = runs[world][case]
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["subgroup", "device_mesh"])
def test_ring_on_a_subgroup(runs: dict, case: str) -> None:
    failures = runs[3][case]
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(120)
def test_example_runs_on_two_processes(runs: dict) -> None:
    """examples/ring_attention.py (as torchrun --nproc-per-node 2 runs it) equals one process."""
    failures = runs[2]["example"]
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(30)
def test_needs_an_initialised_process_group() -> None:
    assert not dist.is_initialized()
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ak.distributed.ring_attention(q, q, q)      # the DESIGN.md spelling


@pytest.mark.timeout(30)
def test_single_rank_group_equals_attention() -> None:
    """World size 1: the ring is one block (no messages), output and gradients as usual."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rdv", rank=0,
                                world_size=1, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        try:
            q, k, v = (torch.randn(2, 3, 6, 5, dtype=torch.float64, requires_grad=True)
                       for _ in range(3))
            out = akd.ring_attention(q, k, v, is_causal=True)
            out.square().sum().backward()
            grads = [t.grad.clone() for t in (q, k, v)]
            for t in (q, k, v):
                t.grad = None
            ref = ak.attention(q, k, v, is_causal=True, backend="reference")
            ref.square().sum().backward()
            _assert_close(out, ref, 1e-12)
            for g, t in zip(grads, (q, k, v), strict=True):
                _assert_close(g, t.grad, 1e-12)
        finally:
            dist.destroy_process_group()


def test_merge_of_key_blocks_equals_attention_over_all_keys() -> None:
    """Splitting the keys in two and merging by LSE gives attention over all keys."""
    q = torch.randn(2, 3, 7, 4, dtype=torch.float64)
    k = torch.randn(2, 3, 10, 4, dtype=torch.float64)
    v = torch.randn(2, 3, 10, 5, dtype=torch.float64)
    want, want_lse = ak.attention(q, k, v, return_lse=True)
    o1, l1 = ak.attention(q, k[:, :, :6], v[:, :, :6], return_lse=True)
    o2, l2 = ak.attention(q, k[:, :, 6:], v[:, :, 6:], return_lse=True)
    out = torch.zeros_like(want)
    lse = torch.full_like(want_lse, -torch.inf)
    for o, lb in ((o1, l1), (o2, l2)):
        out, lse = merge_partials([(out, lse), (o, lb)])
    _assert_close(out, want, 1e-12)
    _assert_close(lse, want_lse, 1e-12)


def test_merge_ignores_fully_masked_blocks() -> None:
    """A block with LSE −∞ (no allowed key) contributes nothing, and never NaN."""
    out = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    lse = torch.tensor([[[0.5, -torch.inf, 2.0], [1.0, -torch.inf, -3.0]]], dtype=torch.float64)
    o_b = torch.zeros_like(out)                # an empty block's output is 0
    lse_b = torch.full_like(lse, -torch.inf)
    m_out, m_lse = merge_partials([(out, lse), (o_b, lse_b)])
    assert torch.equal(m_lse, lse)
    rows = torch.isfinite(lse)
    _assert_close(m_out[rows], out[rows], 1e-15)
    assert (m_out[~rows] == 0).all()     # both empty: output 0, LSE −∞
    share = akd_ring._share(lse_b, lse)
    assert (share == 0).all() and not share.isnan().any()


def test_timeout_default_is_minutes() -> None:
    import inspect
    default = inspect.signature(akd.ring_attention).parameters["timeout"].default
    assert default == akd.DEFAULT_TIMEOUT_S and 60 <= default <= 600, default


@pytest.mark.timeout(30)
def test_double_backward_is_refused_with_the_attnkit_error() -> None:
    """create_graph=True through the hand-written backward ring: one attnkit error, at once."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rdv", rank=0,
                                world_size=1, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        try:
            q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True)
                       for _ in range(3))
            out = akd.ring_attention(q, k, v, is_causal=True)
            with pytest.raises(NotImplementedError, match="first derivatives only") as e:
                torch.autograd.grad(out.square().sum(), q, create_graph=True)
            assert "function 'ring_attention'" in str(e.value)       # not "backend ..."
            assert "Gather the shards" in str(e.value)
            (g,) = torch.autograd.grad(out.square().sum(), q)    # first order still works
            assert torch.isfinite(g).all()
        finally:
            dist.destroy_process_group()
