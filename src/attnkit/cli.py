"""The ``attnkit`` command line: ``attnkit explain`` prints the built-in worked example."""

from __future__ import annotations

import argparse
import sys

from .explain.examples import DEFAULT, EXAMPLES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="attnkit", description="attention, explained")
    sub = parser.add_subparsers(dest="cmd")
    sub.add_parser("explain", help="walk through an attention call step by step")
    args = parser.parse_args(argv)
    if args.cmd in (None, "explain"):
        sys.stdout.write(EXAMPLES[DEFAULT].build().to_text())
        return 0
    return 2
