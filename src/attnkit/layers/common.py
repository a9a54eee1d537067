"""Small helpers every layer module shares: argument checks, the head split, labels.

Internal to :mod:`attnkit.layers` (not re-exported); one copy of each.

Shape legend::

    B batch   N tokens   heads  number of heads   D  width per head
    t (B, N, heads·D)  ⇄  (B, heads, N, D)
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

__all__ = ["shape_of", "positive_int", "head_dims", "check_options", "check_input",
           "split_heads", "merge_heads", "layer_label"]


def shape_of(t: torch.Tensor) -> str:
    """``(2, 5, 16)``: a tensor's shape as errors print it."""
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def positive_int(x: Any, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise ValueError(f"{name} must be a positive integer, got {x!r}")
    return x


def head_dims(d_model: int, n_heads: int, head_dim: Any, v_head_dim: Any) -> tuple[int, int]:
    """``(head_dim, v_head_dim)``: head_dim defaults to d_model / n_heads, v_head_dim to it."""
    if head_dim is None:
        if d_model % n_heads:
            raise ValueError(
                f"d_model={d_model} is not divisible by n_heads={n_heads}: choose n_heads "
                f"that divides d_model, or pass head_dim=... explicitly"
            )
        head_dim = d_model // n_heads
    head_dim = positive_int(head_dim, "head_dim")
    return head_dim, positive_int(head_dim if v_head_dim is None else v_head_dim, "v_head_dim")


def check_options(softcap: float | None, dropout: float) -> None:
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not math.isfinite(softcap) or softcap <= 0):
        raise ValueError(f"softcap must be a finite number > 0 or None, got {softcap!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) \
            or not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}")


def check_input(x: Any, width: int, name: str, param: torch.Tensor) -> torch.Tensor:
    """Validate x (B, N, width) or (N, width) against a layer parameter; return it as 3-D."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in (2, 3) or x.shape[-1] != width:
        raise ValueError(
            f"{name} must have shape (B, N, {width}) or (N, {width}), got {shape_of(x)}: "
            f"its last dim is the feature width, which this layer expects to be {width}"
        )
    if x.dtype != param.dtype:
        raise TypeError(
            f"{name} has dtype {x.dtype} but the layer's parameters are {param.dtype}: "
            f"cast one of them, e.g. layer.to({x.dtype}) or {name}.to({param.dtype})"
        )
    if x.device != param.device:
        raise ValueError(
            f"{name} is on {x.device} but the layer's parameters are on {param.device}: "
            f"move one of them with .to()"
        )
    return x if x.dim() == 3 else x.unsqueeze(0)


def split_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, N, heads·D) → (B, heads, N, D)."""
    b, n, f = t.shape
    return t.view(b, n, heads, f // heads).transpose(1, 2)


def merge_heads(t: torch.Tensor) -> torch.Tensor:
    """(B, heads, N, D) → (B, N, heads·D): the heads concatenated back."""
    b, h, n, d = t.shape
    return t.transpose(1, 2).reshape(b, n, h * d)


def layer_label(layer: nn.Module) -> str:
    """How errors name one layer: ``MultiHeadAttention(d_model=16, n_heads=4, …) at 0x7f…``
    (the address tells apart layers of the same configuration)."""
    return f"{type(layer).__name__}({layer.extra_repr()}) at {id(layer):#x}"
