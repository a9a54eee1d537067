"""How a score_mod is built (native/score_mod.py, codegen.py): what the generated file
includes.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable

import pytest
import torch

from attnkit.backends import native
from attnkit.backends.native import codegen
from attnkit.backends.native import score_mod as sm

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernel unavailable: "
                                                               f"{native.why_unavailable()}")
LIM = codegen.POSITION_LIMIT
_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 5,
                       ctypes.c_void_p)
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])
MODS: dict[str, Callable] = {
    "alibi": lambda s, b, h, q, kv: s - SLOPES[h] * (q - kv),
    "tanh_distance": lambda s, b, h, q, kv: s + 0.137 * torch.tanh((q - kv).float() / 9.5),
    "blocks": lambda s, b, h, q, kv: (s + ((q // 64) == (kv // 64)).to(s.dtype)
                                      + (kv % 7).to(s.dtype) + (q * kv % 1000003).to(s.dtype)),
}
ROWS = [(0, 3, 0, 0, 40), (1, 2, LIM - 1, LIM - 40, 40),          # narrow
        (0, 1, LIM, LIM - 40, 40), (0, 0, 5, LIM - 20, 40),         # just past
        (0, 2, 2**40, 2**40 - 25, 50)]                               # far past


def run_row(call: sm.ScoreModCall, x: torch.Tensor, b: int, h: int, q: int, k0: int,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The bound function on row ``x``: (values, d / d score); raises what check raises."""
    y, dy = x.clone(), torch.zeros(len(x), dtype=x.dtype)
    _FN(call.address)(y.data_ptr(), dy.data_ptr(), len(x), b, h, q, k0, call.caps_address)
    call.check()
    return y, dy


def torch_row(fn: Callable, x: torch.Tensor, b: int, h: int, q: int, k0: int,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    n = len(x)
    x = x.clone().requires_grad_(True)
    idx = [torch.full((n,), i, dtype=torch.int64) for i in (b, h, q)]
    y = fn(x, *idx, torch.arange(k0, k0 + n, dtype=torch.int64))
    g, = torch.autograd.grad(y.sum(), x)
    return y.detach(), g


def generated(fn: Callable, **kw) -> str:  # noqa: ANN003
    """The C++ file compile_score_mod would build for ``fn`` (float32 rows)."""
    got: list[str] = []
    real = sm._build

    def spy(name: str, src: str) -> int:
        got.append(src)
        return real(name, src)

    sm._build = spy
    try:
        sm.compile_score_mod(fn, grad=True, **kw)
    finally:
        sm._build = real
    return got[-1]


def test_the_generated_file_includes_no_cmath_or_type_traits() -> None:
    """<cmath> and <type_traits> were half of each build's compile time; the file includes
    <climits> and <cstdint> only, and calls no std:: function."""
    for fn in (*MODS.values(),
               lambda s, b, h, q, kv: torch.where(q >= kv, torch.erf(s) + s.sin() ** 2.5,
                                                  torch.fmod(s, 0.7).floor() - s.abs().sqrt()),
               lambda s, b, h, q, kv: s + ((q - kv) << 2).float() + ((q - kv) >> 1).float()):
        src = generated(fn)
        assert re.findall(r"#include\s*<([^>]+)>", src) == ["climits", "cstdint"], src[:400]
        assert "std::" not in src
