"""Read the numbers back out of the text walkthrough, the way a learner reads them.

``parse(text)`` → one :class:`Section` per trace (split at the ``=====`` title underlines).
Each section maps a step number ("1".."6") to its printed matrices, one per head.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

STEP = re.compile(r"^\[(\d+)\] (.*?): (.*?)\s{3}\(([\d, ]+)\)\s*$")
HEAD = re.compile(r"^  ((?:batch|배치|head|헤드) \d+(?:, (?:batch|배치|head|헤드) \d+)*)$")
ANSI = re.compile(r"\033\[[0-9;]*m")


def number(tok: str) -> float:
    """A printed cell: 0.506, 0.00005, 1.1e-07, -inf, 16."""
    if tok == "-inf":
        return -math.inf
    return float(tok)


def is_number(tok: str) -> bool:
    try:
        number(tok)
        return True
    except ValueError:
        return False


@dataclass
class Matrix:
    cols: list[str]
    rows: list[str] = field(default_factory=list)
    values: list[list[float]] = field(default_factory=list)
    sums: list[float] = field(default_factory=list)

    def row(self, label: str) -> list[float]:
        return self.values[self.rows.index(label)]


@dataclass
class StepBlock:
    name: str
    formula: str
    shape: tuple[int, ...]
    heads: dict[str, Matrix] = field(default_factory=dict)

    @property
    def matrix(self) -> Matrix:
        """The only (or first) head's matrix."""
        return next(iter(self.heads.values()))


@dataclass
class Section:
    title: str
    lines: list[str]
    steps: dict[str, StepBlock] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def values(self, step: str, head: str | None = None) -> list[list[float]]:
        block = self.steps[step]
        return (block.heads[head] if head else block.matrix).values


def _split_sections(lines: list[str]) -> list[tuple[str, list[str]]]:
    starts = [i for i in range(len(lines) - 1)
              if lines[i].strip() and lines[i + 1] and set(lines[i + 1]) == {"="}]
    if not starts:
        return [("", lines)]
    bounds = [*starts, len(lines)]
    head = [("", lines[:starts[0]])] if any(x.strip() for x in lines[:starts[0]]) else []
    return head + [(lines[s], lines[s:e]) for s, e in zip(bounds, bounds[1:], strict=False)]


def _parse_step(lines: list[str], i: int, block: StepBlock) -> int:
    """Fill ``block`` from the lines after its header; returns the index after the block."""
    current: Matrix | None = None
    label = ""
    expect_header = True
    while i < len(lines) and lines[i].strip():
        line = lines[i]
        m = HEAD.match(line)
        if m:
            label, expect_header = m.group(1).strip(), True
        elif expect_header:
            toks = line.split()
            cols = toks[: toks.index("|")] if "|" in toks else toks
            current = Matrix(cols=cols)
            block.heads[label] = current
            expect_header = False
        else:
            main, _, tail = line.partition(" | ")
            toks = main.split()
            if current is not None and len(toks) >= 2 and all(
                    is_number(t) or t in ("…", "⋮") for t in toks[1:]):
                current.rows.append(toks[0])
                current.values.append([number(t) for t in toks[1:] if is_number(t)])
                if tail.strip():
                    current.sums.append(number(tail.split()[0]))
        i += 1
    return i


def parse(text: str) -> list[Section]:
    """Every trace's printed step matrices (ANSI colour codes are stripped first)."""
    lines = ANSI.sub("", text).splitlines()
    out = []
    for title, body in _split_sections(lines):
        sec = Section(title, body)
        i = 0
        while i < len(body):
            m = STEP.match(body[i])
            if m:
                block = StepBlock(m.group(2), m.group(3),
                                  tuple(int(x) for x in m.group(4).split(",") if x.strip()))
                sec.steps[m.group(1)] = block
                i = _parse_step(body, i + 1, block)
            else:
                i += 1
        out.append(sec)
    return out


def close(printed: float, course: str) -> bool:
    """Does a printed number agree with the course's number to the digits the course gives?"""
    if course in ("-inf", "≈0"):
        return printed == -math.inf if course == "-inf" else 0 <= printed < 1e-6
    decimals = len(course.split(".")[1]) if "." in course else 0
    return abs(printed - float(course)) <= 0.5 * 10 ** (-decimals) + 1e-12


def all_close(printed: list[float], course: list[str]) -> bool:
    return len(printed) == len(course) and all(close(p, c) for p, c in zip(printed, course,
                                                                             strict=True))
