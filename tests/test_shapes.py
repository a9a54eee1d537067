"""attnkit._shapes: tuple broadcasting agrees with torch.broadcast_shapes, errors included."""

from __future__ import annotations

import itertools

import pytest
import torch

from attnkit._shapes import broadcast_shapes

SIZES = (0, 1, 2, 3)


def _torch_or_error(*shapes):
    try:
        return tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        return "error"


def _ours_or_error(*shapes):
    try:
        return broadcast_shapes(*shapes)
    except RuntimeError:
        return "error"


@pytest.mark.parametrize("ranks", [(0, 2), (1, 2), (2, 2), (3, 1), (2, 3, 1)])
def test_agrees_with_torch_on_every_small_shape(ranks):
    pools = [list(itertools.product(SIZES, repeat=r)) for r in ranks]
    for shapes in itertools.product(*pools):
        assert _ours_or_error(*shapes) == _torch_or_error(*shapes), shapes


def test_no_shapes_and_torch_sizes():
    assert broadcast_shapes() == ()
    assert broadcast_shapes(torch.Size([4, 1, 3]), (5, 1)) == (4, 5, 3)
    with pytest.raises(RuntimeError, match=r"dim -1: 3 vs 2"):
        broadcast_shapes((2, 3), (2,))
