"""The CPU engine side by side with torch SDPA, compiled FlexAttention and the naive formula.

    .venv/bin/python benchmarks/bench_cpu.py            # the full target table (~10 min)
    .venv/bin/python benchmarks/bench_cpu.py --quick    # small sizes, < 1 minute
    .venv/bin/python benchmarks/bench_cpu.py --only sliding --no-flex
    .venv/bin/python benchmarks/bench_cpu.py --list               # the case names
    .venv/bin/python benchmarks/bench_cpu.py --json runs/$(date +%F).json --plot ratios.png

Progress (case i of n, elapsed, time left) goes to stderr; the table ends with a noise
verdict from the interleaved yardsticks ("machine busy: ratios uncertain by ±x%").

Same as ``attnkit bench``; see :mod:`attnkit.bench` for the columns.
"""

from __future__ import annotations

import sys

from attnkit.bench import run_cli

if __name__ == "__main__":
    raise SystemExit(run_cli(sys.argv[1:]))
