"""Sequence parallelism on CPU: causal forward+backward of one attention call, 1 process vs
W ranks (ring with contiguous shards, ring with zig-zag shards, Ulysses all-to-all).

Launches the ranks itself (torch.multiprocessing, gloo over 127.0.0.1, one thread per
process). Each mode runs in fresh processes; within a process: a small warm-up call (loads the
native kernel), then one full-size warm-up and ``--repeats`` timed rounds of
``out = f(q, k, v); out.backward(dO)``. Reported per mode (medians over the rounds):

- wall: the slowest rank's time for the round (what a training step waits for);
- compute, slowest / fastest rank: the rank's wall time minus the time it spent waiting in
  the module's collectives (``_Ring._wait``: hops, all-to-alls, option / status checks) —
  its own work, including starting exchanges, packing and merging (on a loaded machine this
  also counts the time the rank was descheduled);
- cpu, slowest / fastest rank: the CPU time of the rank's main thread over the round
  (``time.thread_time``; gloo's own threads excluded) — the compute, robust to load;
  "cpu speedup" = the single process's cpu time ÷ the slowest rank's;
- peak memory: ``ru_maxrss`` (resource.getrusage, the process's peak resident set) minus the
  resident set just before the first full-size call (inputs allocated, kernels loaded); the
  largest over ranks. The peak is started afresh there (Linux: ``5`` written to
  ``/proc/self/clear_refs``), so that the full-length inputs a rank builds, shards and frees
  do not count (where the kernel refuses, the output says so and the peak includes them:
  before this reset, a ring's figure at N=16384 was that of its input building). The
  ranks run with ``MALLOC_MMAP_THRESHOLD_=1048576`` (unless set): glibc then maps every
  block of 1 MiB or more on its own and unmaps it when freed, so the resident set follows
  the live tensors instead of glibc's cache of freed ones (``--keep-malloc`` leaves glibc's
  default, which lets freed 8–32 MB blocks stay resident).

    .venv/bin/python benchmarks/bench_ring.py                     # N=8192, (1, 8, N, 64) fp32
    .venv/bin/python benchmarks/bench_ring.py --n 16384 --repeats 2
    .venv/bin/python benchmarks/bench_ring.py --world 4 --modes zigzag,contiguous  # balance
    .venv/bin/python benchmarks/bench_ring.py --quick             # a smoke run (N=1024)
    .venv/bin/python benchmarks/bench_ring.py --overlap --n 16384  # the exchange's cost

Overlap (``--overlap``): ``zigzag-local`` runs the same blocks with every exchange skipped
(each hop reuses the rank's own K/V: the compute alone), ``zigzag-comm`` the same exchanges
with every block returning zeros at once (the exchange alone); the hidden fraction is
``(compute alone + exchange alone − both) / exchange alone`` (1 = fully overlapped).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("single", "contiguous", "zigzag", "ulysses", "zigzag-local", "zigzag-comm")


def _skip_exchange(akd_c: object) -> None:
    """zigzag-local: no K/V or dK/dV moves; every hop reuses this rank's own shard (the
    same shapes and blocks, wrong values): the compute alone."""
    def local(self: object, sends: object, to: object, like: list | None, frm: object, *,
              what: str, step: str) -> object:
        return akd_c._Hop(None if like is None or frm is None else list(like), [], step)

    akd_c._Ring.exchange = local                    # type: ignore[attr-defined]


def _skip_compute(akd_ring: object) -> None:
    """zigzag-comm: every block returns zeros at once: the exchanges (and the merges) alone."""
    def block(self: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, band: object,
              backend: object = None) -> tuple[torch.Tensor, torch.Tensor]:
        return (q.new_zeros(*q.shape[:-1], v.shape[-1]), q.new_zeros(q.shape[:-1]))

    def grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: object,
              ) -> tuple[torch.Tensor, ...]:
        return tuple(torch.zeros(t.shape, dtype=torch.float32) for t in (q, k, v))

    akd_ring._Options.block = block                 # type: ignore[attr-defined]
    akd_ring._kernel_block_grads = lambda ops, *a: grads(*a)   # type: ignore[attr-defined]
    akd_ring._block_grads = grads                   # type: ignore[attr-defined]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _reset_peak() -> bool:
    """Start the process's peak resident set afresh from its current one (Linux ≥ 4.0:
    ``5`` to /proc/self/clear_refs; ``ru_maxrss`` follows); False where that is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024     # KiB on Linux


def _inputs(args: argparse.Namespace) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, args.n, args.dim)
    return [torch.randn(*shape, generator=g) for _ in range(4)]        # q, k, v, dO


def _worker(mode: str, rank: int, world: int, init: str, args: argparse.Namespace,
            results: object) -> None:
    torch.set_num_threads(1)
    import attnkit as ak
    from attnkit import distributed as akd
    from attnkit.distributed import collectives as akd_c
    from attnkit.distributed import ring as akd_ring

    if mode != "single":
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=1800))
    waited = [0.0]
    real_wait = akd_c._Ring._wait

    def timed_wait(self: akd_c._Ring, *a: object, **kw: object) -> None:
        t0 = time.perf_counter()
        try:
            real_wait(self, *a, **kw)               # type: ignore[arg-type]
        finally:
            waited[0] += time.perf_counter() - t0

    akd_c._Ring._wait = timed_wait                    # type: ignore[method-assign]
    if mode == "zigzag-local":
        _skip_exchange(akd_c)
    if mode == "zigzag-comm":
        _skip_compute(akd_ring)
    layout = "zigzag" if mode.startswith("zigzag") else "contiguous"
    strategy = "ulysses" if mode == "ulysses" else "ring"
    q, k, v, d_out = _inputs(args)
    if mode != "single":
        q, k, v, d_out = (akd.shard_sequence(t, rank, world, layout=layout)
                          for t in (q, k, v, d_out))

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if mode == "single":
            return ak.attention(q, k, v, is_causal=True)
        return akd.ring_attention(q, k, v, is_causal=True, layout=layout, strategy=strategy)

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_out: torch.Tensor) -> None:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        call(*leaves).backward(d_out)

    small = [t[..., :64 * world, :].contiguous() for t in (q, k, v, d_out)]
    step(*small)                                    # loads the native kernel, warms gloo
    base = _rss_mb()
    reset = _reset_peak()                           # the inputs' building does not count
    walls, computes, cpus = [], [], []
    for i in range(args.repeats + 1):               # round 0: full-size warm-up
        if mode != "single":
            dist.barrier()
        waited[0] = 0.0
        c0, t0 = time.thread_time(), time.perf_counter()
        step(q, k, v, d_out)
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        if i:
            walls.append(wall)
            computes.append(wall - waited[0])
            cpus.append(cpu)
    results.put((mode, rank, walls, computes, cpus,  # type: ignore[attr-defined]
                 _maxrss_mb() - base, reset))
    if mode != "single":
        dist.barrier()
        dist.destroy_process_group()


def run_mode(mode: str, world: int, args: argparse.Namespace) -> dict[int, tuple]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    n = 1 if mode == "single" else world
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(mode, r, n, f"{tmp}/rdv", args, results))
                 for r in range(n)]
        for p in procs:
            p.start()
        got = {}
        for _ in range(n):
            m, r, walls, computes, cpus, peak, reset = results.get(timeout=args.timeout)
            got[r] = (walls, computes, cpus, peak, reset)
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=8192, help="global sequence length")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--world", type=int, default=2, help="ranks of the distributed modes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {MODES}")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per mode")
    ap.add_argument("--quick", action="store_true", help="N=1024, one round")
    ap.add_argument("--overlap", action="store_true",
                    help="modes zigzag, zigzag-local, zigzag-comm: the exchange's cost")
    ap.add_argument("--keep-malloc", action="store_true",
                    help="do not set MALLOC_MMAP_THRESHOLD_ for the ranks")
    args = ap.parse_args()
    if not args.keep_malloc:            # inherited by the spawned ranks (read at their start)
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    if args.quick:
        args.n, args.repeats = 1024, 1
    if args.overlap:
        args.modes = "zigzag,zigzag-local,zigzag-comm"
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            ap.error(f"unknown mode {m!r}; choose from {MODES}")

    try:
        cpu = next(line.split(":", 1)[1].strip() for line in subprocess.run(
            ["lscpu"], capture_output=True, text=True).stdout.splitlines()
            if line.startswith("Model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or "?"
    print(f"# bench_ring  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"# command: {shlex.join([sys.executable, *sys.argv])}")
    print(f"# CPU: {cpu}, {os.cpu_count()} logical cores; torch {torch.__version__}; "
          f"one thread per process; gloo")
    print(f"# causal fwd+bwd, q/k/v/dO ({args.batch}, {args.heads}, {args.n}, {args.dim}) "
          f"float32, {args.world} ranks; medians of {args.repeats} round(s)")
    print("# compute = rank wall − its waits in collectives; cpu = its main thread's CPU time; "
          "peak = ru_maxrss − RSS before the first full-size call, the peak reset there "
          "(max over ranks)")
    print(f"# MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', '(glibc default)')}")
    print(f"# load average before: {os.getloadavg()[0]:.2f} (the machine may be shared: "
          "wall and compute are noisy, cpu less so)")
    rows = {}
    for mode in modes:
        got = run_mode(mode, args.world, args)
        ranks = sorted(got)
        walls = [max(got[r][0][i] for r in ranks) for i in range(args.repeats)]
        comp = {r: statistics.median(got[r][1]) for r in ranks}
        cpu_s = {r: statistics.median(got[r][2]) for r in ranks}
        rows[mode] = (statistics.median(walls), max(comp.values()), min(comp.values()),
                      max(cpu_s.values()), min(cpu_s.values()), max(got[r][3] for r in ranks))
        if not all(got[r][4] for r in ranks):
            print(f"# {mode}: the peak could not be reset (/proc/self/clear_refs): it includes "
                  "building the inputs")
        print(f"  ... {mode} done", file=sys.stderr, flush=True)
    ref = rows.get("single")
    print(f"{'mode':<14}{'wall s':>8}{'speedup':>9}{'compute slow/fast s':>21}{'ratio':>7}"
          f"{'cpu slow/fast s':>17}{'ratio':>7}{'cpu speedup':>13}{'peak MB':>9}"
          f"{'mem ratio':>11}")
    for mode, (wall, slow, fast, cslow, cfast, peak) in rows.items():
        speed = f"{ref[0] / wall:.2f}x" if ref else "-"
        cspeed = f"{ref[3] / cslow:.2f}x" if ref else "-"
        mem = f"{peak / ref[5]:.2f}" if ref and ref[5] > 0 else "-"
        print(f"{mode:<14}{wall:>8.2f}{speed:>9}{f'{slow:.2f} / {fast:.2f}':>21}"
              f"{slow / fast if fast else float('nan'):>7.2f}{f'{cslow:.2f} / {cfast:.2f}':>17}"
              f"{cslow / cfast if cfast else float('nan'):>7.2f}{cspeed:>13}{peak:>9.0f}"
              f"{mem:>11}")
    if all(m in rows for m in ("zigzag", "zigzag-local", "zigzag-comm")):
        both, alone, comm = (rows[m][0] for m in ("zigzag", "zigzag-local", "zigzag-comm"))
        hidden = (alone + comm - both) / comm if comm > 0 else float("nan")
        print(f"overlap (zigzag, wall of the slowest rank): compute alone {alone:.2f} s, "
              f"exchange alone {comm:.2f} s, both {both:.2f} s → the exchange adds "
              f"{both - alone:+.2f} s to the compute; hidden fraction "
              f"(alone + exchange − both) / exchange = {hidden:.0%}")


if __name__ == "__main__":
    main()
