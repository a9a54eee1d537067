"""The course's worked examples, built in (``attnkit examples`` lists them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .trace import Trace, explain


@dataclass(frozen=True)
class Example:
    name: str
    description: str
    build: Callable[[], Trace]


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def causal_three_tokens() -> Trace:
    """Three tokens, d_h = 4, causal: row 3 of S is [2, 0, 6] → weights [0.114, 0.042, 0.844]."""
    q = _t([[1, 0, 1, 0], [1, -1, 2, 0], [-1, 1, 1, 2]])
    k = _t([[1, -1, 2, 1], [0, -1, 1, 0], [-2, 0, 0, 2]])
    v = torch.cat([torch.eye(3, dtype=torch.float64), torch.ones(3, 1, dtype=torch.float64)], 1)
    return explain(q, k, v, is_causal=True)


EXAMPLES: dict[str, Example] = {
    "causal": Example("causal", "three tokens, d_h = 4, causal mask (the course's example)",
                      causal_three_tokens),
}
DEFAULT = "causal"
