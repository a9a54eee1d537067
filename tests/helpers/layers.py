"""Helpers shared by the layer tests."""

from __future__ import annotations

import torch
from torch import nn

import attnkit as ak

DT = torch.float64


def n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def decode_in_chunks(m, x, chunks, **kw):
    """Run x (B, N, d) through m chunk by chunk with one cache; concat the outputs."""
    cache = ak.KVCache(**kw)
    outs, i = [], 0
    for n in chunks:
        outs.append(m(x[:, i:i + n], cache=cache, is_causal=True))
        i += n
    assert i == x.shape[1] and cache.length == i
    return torch.cat(outs, 1), cache
