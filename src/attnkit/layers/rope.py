"""Rotary position embeddings (RoPE): each pair of channels of a query or key is rotated by
an angle proportional to the token's position, so that ``q_m · k_n`` depends on the offset
``m − n`` only.

    angle(pos, i) = pos · ω_i        ω_i = θ^(−2i/R)   (i = 0 … R/2 − 1; "inverse frequencies")
    (x_a, x_b) ↦ (x_a cos − x_b sin,  x_b cos + x_a sin)   for each channel pair (a, b)

Two pairings of the R rotated channels (the names used by the model families)::

    style="half"         (Llama, NeoX, Mistral, Qwen, Gemma): channel i pairs with i + R/2
                         x·cos + rotate_half(x)·sin,  rotate_half(x) = [−x₂, x₁]
    style="interleaved"  (GPT-J, the RoFormer paper): channel 2i pairs with 2i + 1

Quick use::

    import attnkit as ak
    rope = ak.rope.RoPE(theta=500_000.0)                  # style="half", all channels
    q = rope(q)                                           # positions 0 … N−1
    k = rope(k, offset=cache_len)                         # decoding: positions start there
    cos, sin = ak.rope.cos_sin(positions, 64)             # or the tables by themselves …
    q = ak.rope.apply(q, cos, sin)                        # … applied to any (…, N, D) tensor
    layer = ak.MultiHeadAttention(512, 8, rope=True)      # rope=RoPE(...) for other settings

Shape legend::

    B batch   H heads   N tokens   D head width (d_k)
    R rotated channels per head (``dims``; even, ≤ D; the other D − R channels pass through)

    x           (…, N, D)   typically (B, H, N, D); the token axis is −2
    positions   (N,) or (B, N)  integer token positions (default: offset + 0 … N−1)
    offset      int, or (B,) integer tensor (per-sequence cache lengths)
    inv_freq    (R/2,)      ω_i, float64
    cos, sin    (N, R) or (B, N, R), laid out for the style:
                half: [ω₀ … ω_{R/2−1}, ω₀ … ω_{R/2−1}]   interleaved: [ω₀, ω₀, ω₁, ω₁, …]

Scaling (longer contexts than the model was trained on)::

    LinearScaling(factor)         ω_i / factor (positions interpolated; "linear" in transformers)
    Llama3Scaling(factor=8, low_freq_factor=1, high_freq_factor=4, original_max_position=8192)
                                  Llama 3.1's per-frequency rule ("llama3" in transformers):
                                  long wavelengths (> L/low) ÷ factor, short (< L/high) kept,
                                  a smooth blend in between

Caution
-------
- Angles are computed in float64 (float32 on MPS, which has no float64) and the tables cast
  to the input's dtype; float16/bfloat16 inputs are rotated in float32 and cast back, so
  the result is at least as precise as the usual in-dtype formula. transformers computes
  its tables in float32: against it, expect agreement to ~1e-7 relative in the tables, not
  to float64 precision.
- Positions are integers (fractional positions come from ``LinearScaling``), ≥ 0; the
  ≥ 0 check reads values, so it runs in eager mode only (not under ``torch.compile``).
- Only the rotation is provided: NTK/YaRN/LongRoPE scalings and "attention_factor"
  multipliers of cos/sin are not (yet).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["RoPE", "LinearScaling", "Llama3Scaling", "STYLES", "inv_frequencies",
           "positions_for", "cos_sin", "apply", "rotate"]

STYLES = ("half", "interleaved")
Style = Literal["half", "interleaved"]


def _number(x: Any, name: str, *, low: float = 0.0, strict: bool = True) -> float:
    ok = not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x) \
        and (x > low if strict else x >= low)
    if not ok:
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {low}, "
                         f"got {x!r}")
    return float(x)


@dataclass(frozen=True)
class LinearScaling:
    """Position interpolation: every frequency divided by ``factor`` (≥ 1 stretches the
    trained context by ``factor``). transformers' ``rope_type="linear"``."""

    factor: float

    def __post_init__(self) -> None:
        _number(self.factor, "LinearScaling.factor")

    def scale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """inv_freq (R/2,) → (R/2,)."""
        return inv_freq / self.factor


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's frequency scaling (transformers' ``rope_type="llama3"``).

    With wavelength λ_i = 2π / ω_i and L = ``original_max_position``: λ_i < L/high_freq_factor
    keeps ω_i, λ_i > L/low_freq_factor gives ω_i / factor, and in between
    ``(1 − s)·ω_i/factor + s·ω_i`` with ``s = (L/λ_i − low) / (high − low)``.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        _number(self.factor, "Llama3Scaling.factor")
        low = _number(self.low_freq_factor, "Llama3Scaling.low_freq_factor")
        high = _number(self.high_freq_factor, "Llama3Scaling.high_freq_factor")
        if high <= low:
            raise ValueError(
                f"Llama3Scaling needs high_freq_factor > low_freq_factor (the blend divides by "
                f"their difference), got high_freq_factor={high}, low_freq_factor={low}"
            )
        n = self.original_max_position
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"Llama3Scaling.original_max_position must be a positive integer "
                             f"(the trained context length), got {n!r}")

    def scale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """inv_freq (R/2,) → (R/2,)."""
        wavelen = 2 * math.pi / inv_freq                                  # (R/2,)
        long_wl = self.original_max_position / self.low_freq_factor       # ÷ factor above
        short_wl = self.original_max_position / self.high_freq_factor     # kept below
        smooth = (self.original_max_position / wavelen - self.low_freq_factor) / \
            (self.high_freq_factor - self.low_freq_factor)                # (R/2,)
        blended = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        out = torch.where(wavelen > long_wl, inv_freq / self.factor, inv_freq)
        medium = (wavelen >= short_wl) & (wavelen <= long_wl)
        return torch.where(medium, blended, out)


Scaling = LinearScaling | Llama3Scaling


def _check_style(style: Any) -> Style:
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES} ('half': Llama/NeoX, 'interleaved': "
                         f"GPT-J), got {style!r}")
    return style


def _check_dims(dims: Any, head_dim: int | None = None) -> int:
    if isinstance(dims, bool) or not isinstance(dims, int) or dims < 2 or dims % 2:
        hint = f" (the head width is {head_dim})" if head_dim is not None else ""
        raise ValueError(
            f"the rotated width must be a positive even integer — channels rotate in pairs — "
            f"got {dims!r}{hint}: use an even head_dim, or rotate only part of each head "
            "with RoPE(dims=<even number>)"
        )
    if head_dim is not None and dims > head_dim:
        raise ValueError(f"RoPE rotates dims={dims} channels but the head width is only "
                         f"{head_dim}: use dims <= {head_dim}")
    return dims


def _check_scaling(scaling: Any) -> Scaling | None:
    if scaling is not None and not isinstance(scaling, (LinearScaling, Llama3Scaling)):
        raise TypeError(f"scaling must be None, attnkit.rope.LinearScaling(factor) or "
                        f"attnkit.rope.Llama3Scaling(...), got {type(scaling).__name__}")
    return scaling


def _angle_dtype(device: torch.device | None) -> torch.dtype:
    return torch.float32 if device is not None and torch.device(device).type == "mps" \
        else torch.float64


def inv_frequencies(dims: int, theta: float = 10000.0, *, scaling: Scaling | None = None,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """ω_i = θ^(−2i/R) for i = 0 … R/2 − 1, scaled: ``(R/2,)`` float64 (float32 on MPS)."""
    dims = _check_dims(dims)
    theta = _number(theta, "theta", low=1.0)
    dt = _angle_dtype(device)
    exponent = torch.arange(0, dims, 2, dtype=dt, device=device) / dims      # (R/2,) in [0, 1)
    inv_freq = 1.0 / theta ** exponent                                       # (R/2,)
    scaling = _check_scaling(scaling)
    return inv_freq if scaling is None else scaling.scale(inv_freq)


def positions_for(n: int, offset: int | torch.Tensor = 0, *,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """The default positions of ``n`` new tokens after ``offset`` earlier ones (a KV cache's
    length): ``(n,)`` for an int offset, ``(B, n)`` for a ``(B,)`` tensor of offsets."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"the number of tokens must be an integer >= 0, got {n!r}")
    if isinstance(offset, torch.Tensor):
        if offset.dim() != 1 or offset.dtype.is_floating_point or offset.dtype.is_complex \
                or offset.dtype == torch.bool:
            raise ValueError(f"offset as a tensor must be a 1-D integer tensor (B,) of per-"
                             f"sequence cache lengths, got {tuple(offset.shape)} {offset.dtype}")
        if not torch.compiler.is_compiling() and offset.numel() and bool(offset.min() < 0):
            raise ValueError(f"offsets must be >= 0 (a cache length), got {offset.tolist()}")
        steps = torch.arange(n, device=offset.device, dtype=torch.int64)
        return offset.to(torch.int64)[:, None] + steps[None]                  # (B, n)
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset must be an integer >= 0 (the number of tokens before these, "
                         f"e.g. a KV cache's length), got {offset!r}")
    return torch.arange(offset, offset + n, device=device, dtype=torch.int64)  # (n,)


def _check_positions(positions: Any, n: int | None = None) -> torch.Tensor:
    if not isinstance(positions, torch.Tensor):
        try:
            positions = torch.as_tensor(positions)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(f"positions must be an integer tensor (N,) or (B, N), got "
                            f"{type(positions).__name__}") from e
    if positions.dtype.is_floating_point or positions.dtype.is_complex \
            or positions.dtype == torch.bool:
        raise TypeError(
            f"positions must be integers (token indices), got dtype {positions.dtype}: pass "
            "e.g. torch.arange(N); for interpolated positions use scaling=LinearScaling(f)"
        )
    if positions.dim() not in (1, 2) or (n is not None and positions.shape[-1] != n):
        want = "(N,) or (B, N)" if n is None else f"({n},) or (B, {n})"
        raise ValueError(f"positions must have shape {want} — one per token — got "
                         f"{tuple(positions.shape)}")
    if not torch.compiler.is_compiling() and positions.numel() and bool(positions.min() < 0):
        # a value check: eager only (under torch.compile it would break the graph)
        raise ValueError(f"positions must be >= 0, got a minimum of {int(positions.min())}")
    return positions


def cos_sin(positions: Any, dims: int, *, theta: float = 10000.0, style: Style = "half",
            scaling: Scaling | None = None, dtype: torch.dtype = torch.float32,
            device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation tables for ``positions`` ``(N,)`` or ``(B, N)``: ``(cos, sin)``, each
    ``(N, R)`` or ``(B, N, R)`` in ``dtype``, laid out for ``style`` (see the module's shape
    legend). ``device`` defaults to the positions' device."""
    positions = _check_positions(positions)
    _check_style(style)
    device = positions.device if device is None else torch.device(device)
    inv_freq = inv_frequencies(dims, theta, scaling=scaling, device=device)   # (R/2,)
    angle = positions.to(device=device, dtype=inv_freq.dtype)[..., None] * inv_freq  # (…, N, R/2)
    if style == "half":
        angle = torch.cat([angle, angle], dim=-1)                            # (…, N, R)
    else:
        angle = angle.repeat_interleave(2, dim=-1)                           # (…, N, R)
    return angle.cos().to(dtype), angle.sin().to(dtype)


def _rotate_pairs(x: torch.Tensor, style: Style) -> torch.Tensor:
    """The 90° turn of every channel pair: (…, R) → (…, R)."""
    if style == "half":
        x1, x2 = x.chunk(2, dim=-1)                                          # (…, R/2) each
        return torch.cat([-x2, x1], dim=-1)                                  # rotate_half
    even, odd = x[..., 0::2], x[..., 1::2]                                   # (…, R/2) each
    return torch.stack([-odd, even], dim=-1).flatten(-2)                     # rotate_every_two


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
          style: Style = "half") -> torch.Tensor:
    """Rotate the first R = ``cos.shape[-1]`` channels of ``x`` (…, N, D); the rest pass
    through. ``cos``/``sin`` ``(N, R)`` broadcast over every leading dim; ``(B, N, R)``
    (per-sequence positions) over the heads of a ``(B, H, N, D)`` ``x``. Returns ``x``'s
    shape, dtype and device."""
    _check_style(style)
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError(f"x must be a tensor (…, N, D) with at least 2 dims, got "
                         f"{getattr(x, 'shape', type(x).__name__)}")
    if cos.shape != sin.shape or cos.dim() not in (2, 3):
        raise ValueError(f"cos and sin must both be (N, R) or (B, N, R), got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    n, d, r = x.shape[-2], x.shape[-1], cos.shape[-1]
    _check_dims(r, d)
    if cos.shape[-2] != n:
        raise ValueError(f"the tables are for {cos.shape[-2]} tokens but x {tuple(x.shape)} "
                         f"has N={n}: build them for x's positions")
    if cos.dim() == 3:
        if x.dim() != 4 or cos.shape[0] not in (1, x.shape[0]):
            raise ValueError(f"per-sequence tables (B, N, R) = {tuple(cos.shape)} need x as "
                             f"(B, H, N, D) with the same B, got x {tuple(x.shape)}")
        cos, sin = cos[:, None], sin[:, None]                                # (B, 1, N, R)
    if cos.device != x.device:
        raise ValueError(f"the tables are on {cos.device} but x is on {x.device}: build them "
                         f"with device=x.device")
    work = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    xr = x[..., :r].to(work)                                                 # (…, N, R)
    cos, sin = cos.to(work), sin.to(work)
    out = (xr * cos + _rotate_pairs(xr, style) * sin).to(x.dtype)            # (…, N, R)
    return out if r == d else torch.cat([out, x[..., r:]], dim=-1)           # (…, N, D)


@dataclass(frozen=True)
class RoPE:
    """One rotary-embedding setting, callable on a tensor: ``rope(x, positions=None,
    offset=0)`` rotates ``x`` (…, N, D).

    Args:
        theta: the base θ of ω_i = θ^(−2i/R) (10 000 in Llama 2 / GPT-J, 500 000 in Llama 3).
        dims: rotated channels per head R (even); default all of the head. GPT-J and NeoX
            rotate part of each head (``rotary_dim``, ``rotary_pct``).
        style: ``"half"`` (Llama/NeoX) or ``"interleaved"`` (GPT-J).
        scaling: ``None``, :class:`LinearScaling` or :class:`Llama3Scaling`.
    """

    theta: float = 10000.0
    dims: int | None = None
    style: Style = "half"
    scaling: Scaling | None = None

    def __post_init__(self) -> None:
        _number(self.theta, "theta", low=1.0)
        if self.dims is not None:
            _check_dims(self.dims)
        _check_style(self.style)
        _check_scaling(self.scaling)

    def rotated_dims(self, head_dim: int) -> int:
        """R for heads of width ``head_dim`` (checked: even, ≤ head_dim)."""
        return _check_dims(head_dim if self.dims is None else self.dims, head_dim)

    def tables(self, positions: Any, head_dim: int, *, dtype: torch.dtype = torch.float32,
               device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`cos_sin` with this setting, for heads of width ``head_dim``."""
        return cos_sin(positions, self.rotated_dims(head_dim), theta=self.theta,
                       style=self.style, scaling=self.scaling, dtype=dtype, device=device)

    def __call__(self, x: torch.Tensor, positions: Any = None, *,
                 offset: int | torch.Tensor = 0) -> torch.Tensor:
        return rotate(x, positions, offset=offset, rope=self)


def rotate(x: torch.Tensor, positions: Any = None, *, offset: int | torch.Tensor = 0,
           rope: RoPE | None = None) -> torch.Tensor:
    """Rotate ``x`` (…, N, D) by the positions ``(N,)``/``(B, N)`` (default
    ``offset + 0 … N−1``) with the setting ``rope`` (default ``RoPE()``: θ = 10 000, half
    style, every channel). Same shape, dtype and device as ``x``."""
    rope = RoPE() if rope is None else rope
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError(f"x must be a tensor (…, N, D) with at least 2 dims, got "
                         f"{getattr(x, 'shape', type(x).__name__)}")
    n = x.shape[-2]
    if positions is None:
        positions = positions_for(n, offset, device=x.device)
    elif not (isinstance(offset, int) and not isinstance(offset, bool) and offset == 0):
        raise ValueError("give positions=... or offset=..., not both: positions are absolute")
    positions = _check_positions(positions, n)
    table_dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    cos, sin = rope.tables(positions, x.shape[-1], dtype=table_dtype, device=x.device)
    return apply(x, cos, sin, style=rope.style)
