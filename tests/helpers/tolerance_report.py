"""The tightest tolerance margins of a test run, to audit the tolerances on a new CPU.

    ATTNKIT_TOLERANCE_LOG=/tmp/tol.jsonl python -m pytest tests/backends tests/test_api.py
    python tests/helpers/tolerance_report.py /tmp/tol.jsonl [N]

Each line of the log is one comparison (``helpers.tolerance.log_margin``): the error and the
budget it had. The report lists the N comparisons with the least headroom (budget ÷ error), one
per test and quantity: below ~2 a tolerance is at the mercy of the next CPU's rounding.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip())
        return 2
    top = int(argv[1]) if len(argv) > 1 else 25
    worst: dict[tuple[str, str], dict] = {}
    with open(argv[0]) as f:
        for line in f:
            r = json.loads(line)
            r["headroom"] = r["budget"] / r["err"] if r["err"] > 0 else float("inf")
            key = (r["test"].split(" (")[0], r["what"])
            if key not in worst or r["headroom"] < worst[key]["headroom"]:
                worst[key] = r
    rows = sorted(worst.values(), key=lambda r: r["headroom"])[:top]
    print(f"{'headroom':>9}  {'error':>9}  {'budget':>9}  dtype           test :: what")
    for r in rows:
        print(f"{r['headroom']:9.2f}  {r['err']:9.3g}  {r['budget']:9.3g}  {r['dtype']:<15} "
              f"{r['test'].split(' (')[0]} :: {r['what']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
