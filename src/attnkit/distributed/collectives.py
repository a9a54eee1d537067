"""Talking to the other ranks: the ring's neighbours, exchanges and small collectives, each
with a deadline and an error that names this rank, the peer and the step; and the status
check that makes failures collective (every rank raises together)."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0   # the longest wait for a peer (seconds) unless the caller says


class RingAttentionError(RuntimeError):
    """A ring hop failed, timed out or lost its peer, or another rank of the group failed:
    the message names this rank, the peer or the failing rank, and the hop."""


@dataclass
class _Hop:
    """One started exchange: the receive buffers (valid after :meth:`_Ring.wait`; None when
    this rank receives nothing) and the requests, each with what it moves and to/from whom
    (for the error message)."""

    recv: list[torch.Tensor] | None
    works: list[tuple[Any, str, int]]    # (request, "sending the K/V shard to", peer rank)
    step: str                            # "forward hop 1", "backward hop 0"


class _Ring:
    """Who this rank is in the group, how to talk to its peers, and how long to wait."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._world = group is None or group is dist.group.WORLD
        self.backend = str(dist.get_backend(group))
        self.device = torch.device("cpu")   # where small collectives' tensors live
        self.timeout: float | None = DEFAULT_TIMEOUT_S

    def peer(self, offset: int) -> int:
        """The group rank ``offset`` places after this one (mod the group size)."""
        return (self.rank + offset) % self.size

    def _global(self, r: int) -> int:
        return r if self._world else dist.get_global_rank(self.group, r)

    def exchange(self, sends: list[torch.Tensor] | None, to: int | None,
                 like: list[torch.Tensor] | None, frm: int | None, *, what: str,
                 step: str) -> _Hop:
        """Start sending ``sends`` (``what``) to group rank ``to`` and receiving tensors shaped
        like ``like`` from group rank ``frm`` (either side None: nothing that way). The
        tensors of ``sends`` must be contiguous and not modified before :meth:`wait`."""
        recv = None if like is None or frm is None else [torch.empty_like(t) for t in like]
        ops = []
        if sends is not None and to is not None:
            ops += [dist.P2POp(dist.isend, t, self._global(to), self.group) for t in sends]
        if recv is not None:
            ops += [dist.P2POp(dist.irecv, t, self._global(frm), self.group) for t in recv]
        if not ops:
            return _Hop(recv, [], step)
        peers = " and ".join(str(r) for r in (to, frm) if r is not None)
        try:
            reqs = dist.batch_isend_irecv(ops)
        except RuntimeError as e:
            raise self._lost(e, step, f"starting to exchange {what} with ranks "
                                      f"{peers}") from e
        roles = ([(f"sending {what} to", to)] * len(sends or []) if to is not None else []) + \
            ([(f"receiving {what} from", frm)] * len(recv) if recv is not None else [])
        if len(reqs) != len(roles):     # a coalesced backend returns one request for all
            roles = [(f"exchanging {what} with", to if to is not None else frm)] * len(reqs)
        return _Hop(recv, [(r, a, p) for r, (a, p) in zip(reqs, roles, strict=True)], step)

    def wait(self, hop: _Hop) -> list[torch.Tensor] | None:
        """The received buffers once the exchange is done; a clear error after ``timeout``."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        for work, action, peer in hop.works:
            self._wait(work, deadline, hop.step, f"{action} rank {peer}")
        return hop.recv

    def shift(self, t: torch.Tensor, offset: int, chunk: int, *, what: str, step: str) -> None:
        """In place: ``t`` (contiguous) goes to the rank ``offset`` places on, and the
        previous such rank's ``t`` takes its place — ``chunk`` elements at a time, so that
        the only extra buffer is one chunk (waited chunk by chunk: not overlapped)."""
        flat = t.view(-1)
        for at in range(0, flat.numel(), max(1, chunk)):
            part = flat[at:at + chunk]
            got = self.wait(self.exchange([part], self.peer(offset), [part],
                                          self.peer(-offset), what=what, step=step))
            assert got is not None
            part.copy_(got[0])

    def all_gather(self, row: list[int], step: str) -> list[list[int]]:
        """Every rank's ``row`` (small int64 vectors of one length), within ``timeout``."""
        mine = torch.tensor(row, dtype=torch.int64, device=self.device)
        if self.size == 1:
            return [row]
        rows = [torch.empty_like(mine) for _ in range(self.size)]
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        try:
            work = dist.all_gather(rows, mine, group=self.group, async_op=True)
        except RuntimeError as e:
            raise self._lost(e, step, "the all-gather with every rank of the group") from e
        self._wait(work, deadline, step, "the all-gather with every rank of the group")
        return [r.tolist() for r in rows]

    def all_to_all(self, send: torch.Tensor, step: str) -> torch.Tensor:
        """Chunk j of ``send`` (W, M) to rank j, chunk i of the result from rank i, within
        ``timeout``."""
        if self.size == 1 or send.numel() == 0:
            return send.clone()
        recv = torch.empty_like(send)
        doing = "the all-to-all with every rank of the group"
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        try:
            work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        except RuntimeError as e:
            raise self._lost(e, step, doing) from e
        self._wait(work, deadline, step, doing)
        return recv

    def _wait(self, work: Any, deadline: float | None, step: str, doing: str) -> None:
        try:
            if deadline is None:
                work.wait()
            else:
                work.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
        except RuntimeError as e:      # gloo / NCCL errors (DistBackendError is one too)
            raise self._lost(e, step, doing) from e

    def _lost(self, e: Exception, step: str, doing: str) -> RingAttentionError:
        """The error for a wait that failed: which rank, which hop, what it was doing, why."""
        raw = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip()).split(". ")[0][:200]
        where = f"ring_attention on rank {self.rank} (of {self.size}), {step}: {doing}"
        if "timed out" in raw.lower() or "timeout" in raw.lower():
            limit = ("the process group's timeout" if self.timeout is None
                     else f"timeout={self.timeout:g} s")
            return RingAttentionError(
                f"{where} did not complete within {limit}. The rank it "
                "waits for failed, crashed, did not make the same call (ring_attention, or "
                "the backward of its result), or is that much slower: see that rank's log, "
                "or pass a larger `timeout` if the ranks are legitimately that far apart. "
                "The process group cannot be used after this.")
        if re.search(r"connection|closed|reset|broken pipe|read error|write error", raw.lower()):
            return RingAttentionError(
                f"{where} failed: the connection was lost ({raw}). The peer most likely "
                "crashed or exited: see its log. The process group cannot be used after this.")
        return RingAttentionError(f"{where} failed: {raw}")

    def settle(self, failure: Exception | None, hop: int, phase: str,
               where: str | None = None) -> None:
        """After a ring: every rank learns whether any rank's computation failed (one small
        all-gather), and then all raise together instead of leaving peers waiting. ``where``
        names the step instead of "<phase> hop <hop>" (the all-to-all strategy's one call)."""
        rows = self.all_gather([hop if failure is not None else -1],
                               f"the status check after the {phase}")

        def at(h: int) -> str:
            return where if where is not None else f"{phase} hop {h}"

        if failure is not None:
            if hasattr(failure, "add_note"):        # Python ≥ 3.11
                failure.add_note(f"ring_attention: raised on rank {self.rank} in {at(hop)}; "
                                 "the other ranks raise RingAttentionError naming it")
            raise failure
        bad = [f"rank {i} in {at(r[0])}" for i, r in enumerate(rows) if r[0] >= 0]
        if bad:
            raise RingAttentionError(
                f"ring_attention: {', '.join(bad)} failed (its error is raised there); rank "
                f"{self.rank} stops with it, and no rank returns a result")
