"""How a score_mod is built (native/score_mod.py, codegen.py): what the generated file
includes, and the int64 variant built only for a call whose positions reach
``codegen.POSITION_LIMIT`` (2^24).

A call up to that size gets the narrow (int32-position) variant alone; a larger call, or
:meth:`CompiledScoreMod.bind` without the call's extent, builds the full library (both
variants) first, and a failed build of it leaves the call its Python path with one warning.
Values are compared with torch running the same function over the row (as in
``test_native_score_mod_ops.py``), beside the limit and far past it.

Shape legend: x, dx (n,) one row of keys k0 .. k0 + n - 1.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable

import pytest
import torch

import attnkit as ak
from attnkit.backends import native
from attnkit.backends.native import codegen
from attnkit.backends.native import score_mod as sm
from attnkit.backends.tiled import counting
from helpers.score_mod_rows import call_row, torch_row

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernel unavailable: "
                                                               f"{native.why_unavailable()}")
LIM = codegen.POSITION_LIMIT
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
    call_row(call.address, call.caps_address, y, dy, b, h, q, k0)
    call.check()
    return y, dy



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


@pytest.mark.parametrize("name", list(MODS))
def test_a_call_below_the_limit_builds_the_narrow_variant_alone(name: str) -> None:
    fn = MODS[name]
    src = generated(fn, extent=LIM)
    assert "ak_rows_n<" in src and "ak_rows<" not in src       # no int64 loop compiled
    full = generated(fn)
    assert "ak_rows_n<" in full and "ak_rows<" in full
    mod = sm.compile_score_mod(fn, grad=True, extent=4096)
    assert mod.limit == LIM and mod.serves(LIM) and not mod.serves(LIM + 1)
    assert not mod.serves(None)
    g = torch.Generator().manual_seed(3)
    narrow_call = mod.bind(4096)
    assert mod.limit == LIM                                     # still narrow: not rebuilt
    for b, h, q, k0, n in ROWS[:2]:
        x = torch.randn(n, generator=g)
        y, dy = run_row(narrow_call, x, b, h, q, k0)
        want, dwant = torch_row(fn, x, b, h, q, k0)
        torch.testing.assert_close(y, want, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(dy, dwant, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="narrow build"):     # never a silent wrong row
        run_row(narrow_call, torch.zeros(40), *ROWS[2][:4])


@pytest.mark.parametrize("name", list(MODS))
def test_a_larger_call_widens_the_build_on_both_sides_of_the_limit(name: str) -> None:
    fn = MODS[name]
    mod = sm.compile_score_mod(fn, grad=True, extent=100)
    narrow = mod.address
    call = mod.bind(LIM + 1)                                    # a call past the limit
    assert mod.limit is None and mod.full_source is None and call.address != narrow
    g = torch.Generator().manual_seed(4)
    for b, h, q, k0, n in ROWS:
        x = torch.randn(n, generator=g)
        y, dy = run_row(call, x, b, h, q, k0)
        want, dwant = torch_row(fn, x, b, h, q, k0)
        torch.testing.assert_close(y, want, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(dy, dwant, rtol=0, atol=0)
    assert mod.bind().address == call.address                   # no extent: the full build


def test_for_problem_serves_each_calls_extent() -> None:
    """The kernel's path: a small call gets the narrow build; a later call of the same
    score_mod past the limit gets it widened (one more build), a small one again reuses it."""
    sm.clear()

    def mod(s, b, h, q, kv):  # noqa: ANN001, ANN202
        return s - 0.0311 * (q - kv).abs().float()

    small = sm.for_problem(mod, torch.float32, 128)
    assert isinstance(small, sm.CompiledScoreMod) and small.limit == LIM
    same = sm.for_problem(mod, torch.float32, 2048)
    assert same is small and same.limit == LIM                  # trace reused, not widened
    big = sm.for_problem(mod, torch.float32, LIM + 5)
    assert big is small and big.limit is None
    q = torch.randn(1, 4, 70, 16)

    def fresh(s, b, h, q, kv):  # noqa: ANN001, ANN202
        return s - 0.0277 * (q - kv).abs().float()

    for fn in (mod, fresh):
        with warnings.catch_warnings(), counting() as n:
            warnings.simplefilter("error")
            out = ak.attention(q, q, q, score_mod=fn, backend="tiled")
        ref = ak.attention(q.double(), q.double(), q.double(), score_mod=fn,
                           backend="reference")
        assert n["native"] == 1 and (out.double() - ref).abs().max() < 1e-5
    kernel_built = sm.for_problem(fresh, torch.float32, 70)    # what the kernel's call built
    assert isinstance(kernel_built, sm.CompiledScoreMod) and kernel_built.limit == LIM


def test_a_failed_wide_build_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path) -> None:  # noqa: ANN001
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path))
    sm.clear()

    def mod(s, b, h, q, kv):  # noqa: ANN001, ANN202
        return s + 0.0173 * (q - kv).float()

    got = sm.for_problem(mod, torch.float32, 64)
    assert isinstance(got, sm.CompiledScoreMod) and got.limit == LIM
    real = sm._build

    def failing(name: str, src: str) -> int:                    # the int64 variant fails
        if "ak_rows<" in src:
            sm._fail("full:" + name, name, "the C++ build failed (stand-in)")
        return real(name, src)

    monkeypatch.setattr(sm, "_build", failing)
    with pytest.warns(RuntimeWarning, match="stand-in"):
        why = sm.for_problem(mod, torch.float32, LIM + 1)
    assert isinstance(why, str) and "stand-in" in why
    with warnings.catch_warnings():
        warnings.simplefilter("error")                          # one warning, not one per call
        assert isinstance(sm.for_problem(mod, torch.float32, LIM + 1), str)
        small = sm.for_problem(mod, torch.float32, 64)          # small calls keep the narrow
    assert small is got and got.limit == LIM
    sm.clear()
