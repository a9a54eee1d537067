"""Helpers shared by the layer tests (imported as ``layer_helpers``)."""

from __future__ import annotations

import math

import torch
from torch import nn

import attnkit as ak

DT = torch.float64


DT = torch.float64


def n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def hand_attention(q, k, v, *, scale, softcap=None, allowed=None):
    """softmax(cap(q kᵀ·scale) + mask) v, written out in float64; GQA by repeating heads."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    return torch.softmax(s, -1) @ v


def decode_in_chunks(m, x, chunks, **kw):
    """Run x (B, N, d) through m chunk by chunk with one cache; concat the outputs."""
    cache = ak.KVCache(**kw)
    outs, i = [], 0
    for n in chunks:
        outs.append(m(x[:, i:i + n], cache=cache, is_causal=True))
        i += n
    assert i == x.shape[1] and cache.length == i
    return torch.cat(outs, 1), cache
