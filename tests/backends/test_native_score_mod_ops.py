"""Every op and dtype the score_mod compiler accepts, against torch on the same function.

The compiled C function (``CompiledScoreMod.bind()``: ``attnkit_mod(x, dx, n, b, h, q, k0,
caps, scale)``, scale 1) is called directly through ctypes over one row of keys and compared
elementwise with torch running the op on the same values. One build holds many ops: the
score_mod is a chain ``where(h == i, op_i(...), ...)``, called once per ``h``. Operands are
edge values (zero, ±0, negatives, NaN, ±inf, overflow, huge and tiny magnitudes, halfway
cases) read from captured tables by ``kv_idx`` (the row holds the float operand itself, so
derivatives by the score are checked too). Exact ops must agree bit for bit (NaN with NaN);
functions torch computes with its own approximations (``exp``, ``sin``, float32 ``sqrt``,
general ``pow``, ...) within a few ulp of the result's dtype. Integer results come back as two
float64 channels (the value, and its low 16 bits: int64 beyond 2^53 is checked too).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

import attnkit as ak
from attnkit.backends import native
from attnkit.backends.native import score_mod as sm
from attnkit.backends.native.codegen import Gen, Unsupported
from helpers.score_mod_rows import ROW_FN, call_row, torch_row

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernel unavailable: "
                                                               f"{native.why_unavailable()}")
F64 = torch.float64
FLOATS = [torch.float32, F64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
DTYPES = FLOATS + INTS + [torch.bool]

FLOAT_EDGES = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 1.5, -2.5, 2.5, 3.7, -3.7, 0.1, 1e-3, 7.0,
               -7.0, 100.25, 2047.0, 1000.3, -65504.0, 65520.0, 3e9, 2.0**31, -2.0**63, 1e19,
               3e38, -1e-40, 1e-8, 2.0**-24 * 1.5, 1.0 + 2.0**-11 + 2.0**-40, math.inf,
               -math.inf, math.nan]
INT_EDGES = [0, 1, -1, 2, -2, 3, 7, -7, 8, 63, 64, 127, -128, 128, 255, 256, -129, 32767,
             -32768, 65535, 2**31 - 1, -2**31, 2**31, 2**53 + 1, -2**53 - 3, 2**62 + 12345,
             -2**63, 2**63 - 1]

# ops torch computes with its own approximations: compared to within ULPS ulp of the result
APPROX = {"exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "tanh",
          "sigmoid", "sin", "cos", "erf", "pow", "pow_1.0006", "pow_0.5", "pow_-0.5", "pow_4",
          "pow_scalar"}
ULPS = 4
EPS = {torch.float32: 2.0**-23, F64: 2.0**-52, torch.float16: 2.0**-10,
       torch.bfloat16: 2.0**-7}
# below these an approximate function may differ absolutely (float16: a subnormal ulp or
# so; torch's bfloat16 erf flushes results near 1e-8 to 0)
TINY = {torch.float32: 1e-37, F64: 1e-300, torch.float16: ULPS * 2.0**-24,
        torch.bfloat16: 1e-6}


# ---------------------------------------------------------------- the ops, as a user writes
def _cast_to(dtype: torch.dtype) -> Callable[[Any], Any]:
    return lambda a: a.to(dtype)


UNARY: dict[str, Callable[[Any], Any]] = {
    "neg": torch.neg, "pos": torch.positive, "abs": torch.abs, "exp": torch.exp,
    "exp2": torch.exp2, "expm1": torch.expm1, "log": torch.log, "log2": torch.log2,
    "log10": torch.log10, "log1p": torch.log1p, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
    "tanh": torch.tanh, "sigmoid": torch.sigmoid, "sin": torch.sin, "cos": torch.cos,
    "erf": torch.erf, "reciprocal": torch.reciprocal, "relu": torch.relu,
    "square": torch.square, "sign": torch.sign, "floor": torch.floor,
    "ceil": torch.ceil, "trunc": torch.trunc, "round": torch.round, "frac": torch.frac,
    "invert": operator.invert, "logical_not": torch.logical_not,
    "full_like": lambda a: torch.full_like(a, 2.7), "half": lambda a: a.half(),
    "bfloat16": lambda a: a.bfloat16(),
    **{f"to_{str(d)[6:]}": _cast_to(d) for d in DTYPES},
    "half_float": lambda a: a.half().float(), "bf16_double": lambda a: a.bfloat16().double(),
    # clamps (literal bounds: NaN bound, lo > hi), where, masked_fill
    "clamp": lambda a: torch.clamp(a, -2.5, 100.25), "clamp_int": lambda a: a.clamp(-2, 100),
    "clamp_min": lambda a: torch.clamp_min(a, 0.5), "clamp_max": lambda a: a.clamp(max=-0.5),
    "clamp_nan": lambda a: a.clamp(min=math.nan), "clamp_empty": lambda a: a.clamp(3, -3),
    "where": lambda a: torch.where(a > 0, a, 2047.4),
    "masked_fill": lambda a: a.masked_fill(a < 1, 7.5),
    # Python numbers: kept in float (+ - * / //) or rounded to the tensor's dtype (the rest)
    "add_s": lambda a: a + 0.6, "rsub_s": lambda a: 0.6 - a, "mul_s": lambda a: a * 1.0006,
    "div_s": lambda a: a / 0.9997, "floordiv_s": lambda a: a // 0.9997,
    "mod_s": lambda a: a % 1000.3, "fmod_s": lambda a: torch.fmod(a, 1000.3),
    "ge_s": lambda a: a >= 2047.4, "eq_s": lambda a: a == 2047.4,
    "pow_1.0006": lambda a: a ** 1.0006, "pow_0.5": lambda a: a ** 0.5,
    "pow_-0.5": lambda a: a ** -0.5, "pow_2": lambda a: a ** 2, "pow_3": lambda a: a ** 3,
    "pow_4": lambda a: a ** 4, "pow_-1": lambda a: a ** -1, "pow_-2": lambda a: a ** -2,
    "pow_scalar": lambda a: 2.0 ** a, "add_i": lambda a: a + 3, "mul_i": lambda a: a * 3,
    "sub_i": lambda a: a - 100, "floordiv_i": lambda a: a // 3, "mod_i": lambda a: a % -3,
    "div_i": lambda a: a / 3, "lshift_i": lambda a: a << 3, "rshift_i": lambda a: a >> 2,
    "and_i": lambda a: a & 90, "xor_i": lambda a: a ^ 7, "lt_i": lambda a: a < 2049,
}
BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "add": torch.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv,
    "floor_divide": operator.floordiv, "div_trunc": lambda a, b: torch.div(a, b,
                                                                        rounding_mode="trunc"),
    "div_floor": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "remainder": torch.remainder, "fmod": torch.fmod, "pow": torch.pow,
    "minimum": torch.minimum, "maximum": torch.maximum, "fmin": torch.fmin, "fmax": torch.fmax,
    "lt": operator.lt, "le": torch.le, "gt": torch.gt, "ge": operator.ge, "eq": operator.eq,
    "ne": torch.ne, "logical_and": torch.logical_and, "logical_or": torch.logical_or,
    "logical_xor": torch.logical_xor, "bitwise_and": operator.and_,
    "bitwise_or": torch.bitwise_or, "bitwise_xor": operator.xor, "lshift": operator.lshift,
    "rshift": torch.bitwise_right_shift, "where": lambda a, b: torch.where(a > b, a, b),
    "clamp_t": lambda a, b: torch.clamp(a, min=b), "masked_fill_t": lambda a, b: a.masked_fill(
        b > 1, 1.5), "max_t": lambda a, b: torch.clamp(a, max=b),
}
MIXED_OPS = ["add", "sub", "mul", "div", "floor_divide", "remainder", "pow", "maximum", "fmin",
             "lt", "eq", "bitwise_and", "lshift", "where", "clamp_t"]
NONZERO = {"floor_divide", "div_trunc", "div_floor", "remainder", "fmod"}  # int b: never 0
MIXED = [(torch.int8, torch.uint8), (torch.uint8, torch.int16), (torch.int32, torch.int64),
         (torch.int64, torch.float16), (torch.int32, torch.bfloat16),
         (torch.float16, torch.bfloat16), (torch.float32, F64), (torch.bool, torch.int8),
         (torch.bool, torch.float16), (torch.float16, torch.float32),
         (torch.int64, torch.float32), (torch.uint8, F64)]


# ---------------------------------------------------------------- operands and the chain
def edges(dtype: torch.dtype) -> list[float] | list[int]:
    return FLOAT_EDGES if dtype.is_floating_point else INT_EDGES


class Case:
    """One op on operands of dtypes ``da`` (and ``db``): the score-mod side (``a`` from the
    row for floats, else a captured int64 table; ``b`` from a captured table) and torch's."""

    def __init__(self, name: str, op: Callable, da: torch.dtype, db: torch.dtype | None,
                 ) -> None:
        self.name, self.op, self.da, self.db = name, op, da, db
        self.rdtype = torch.float64                                  # set by chain()
        ea, eb = edges(da), (edges(db) if db is not None else [0])
        av = [a for a in ea for _ in eb]                          # all pairs (a, b)
        bv = [b for _ in ea for b in eb]
        if db is not None and not db.is_floating_point and name in NONZERO:
            # torch raises for b = 0, and its process dies for MIN // -1 (int32 / int64)
            wa, wb = (torch.tensor(v).to(d).long().tolist() for v, d in ((av, da), (bv, db)))
            lo = -2**63 if torch.int64 in (da, db) else -2**31
            bv = [1 if y == 0 or (y == -1 and x == lo) else b
                  for x, y, b in zip(wa, wb, bv, strict=True)]
        self.n = len(av)
        store = F64 if da.is_floating_point else torch.int64
        self.x = torch.tensor(av, dtype=store)                    # the row (floats: scores)
        self.ta = self.x.clone()
        self.tb = torch.tensor(bv, dtype=F64 if db is not None and db.is_floating_point
                               else torch.int64)

    def pad(self, n: int) -> None:
        """Tables of ``n`` entries (a chain's cases read each other's tables on every key)."""
        reps = -(-n // self.n)
        self.ta, self.tb = (t.repeat(reps)[:n] for t in (self.ta, self.tb))

    def operands(self, s: torch.Tensor, kv: torch.Tensor) -> tuple:
        a = (s if self.da.is_floating_point else self.ta[kv]).to(self.da)
        return a, (None if self.db is None else self.tb[kv].to(self.db))

    def apply(self, a: Any, b: Any) -> Any:
        return self.op(a) if self.db is None else self.op(a, b)

    def per_score(self, rows: list[int]) -> torch.Tensor:
        """torch on 0-d operands, one score at a time (``rows`` of the row)."""
        out = []
        for j in rows:
            kv = torch.tensor(j)
            a, b = self.operands(self.x[j], kv)
            out.append(self.apply(a, b))
        return torch.stack(out)

    def reference(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """torch on the whole row: the result, and d result / d score (float operands)."""
        x = self.x.clone().requires_grad_(self.da.is_floating_point)
        a, b = self.operands(x, torch.arange(self.n))
        r = self.apply(a, b)
        g = None
        if r.requires_grad and r.dtype.is_floating_point:
            g, = torch.autograd.grad(r.double().sum(), x, allow_unused=True)
        return r.detach(), g


def channels(r: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """An op's result (of ``dtype``) as float64 values: integers also by their low 16 bits."""
    if dtype.is_floating_point or dtype == torch.bool:
        return [r.double()]
    return [r.double(), (r.long() & 0xFFFF).double()]


def chain(cases: list[Case]) -> tuple[Callable, list[tuple[Case, int]]]:
    """One score_mod evaluating ``cases``: ``h`` picks the case and output channel."""
    picks = []
    for c in cases:
        a, b = c.operands(torch.zeros(()), torch.zeros((), dtype=torch.long))
        c.rdtype = c.apply(a, b).dtype
        picks += [(c, i) for i in range(len(channels(c.apply(a, b), c.rdtype)))]

    def mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        out = torch.zeros((), dtype=F64)
        for j, (c, i) in enumerate(picks):
            x, y = c.operands(score, kv_idx)
            out = torch.where(h == j, channels(c.apply(x, y), c.rdtype)[i], out)
        return out

    return mod, picks


def compiles(*cases: Case) -> str | None:
    """None when the chain of ``cases`` traces and generates, else the reason (no build)."""
    mod = chain(list(cases))[0]
    try:
        gm, ex = sm._trace(mod, F64)
        Gen(gm, ex, False, F64).run()
    except Unsupported as e:
        return str(e)
    return None


def cases_for(da: torch.dtype, db: torch.dtype | None, ops: dict) -> list[Case]:
    """The ops torch itself runs on these dtypes (and values)."""
    out = []
    for name, op in ops.items():
        c = Case(name, op, da, db)
        try:
            c.reference()
        except (RuntimeError, TypeError, NotImplementedError):
            continue                                    # torch refuses: nothing to match
        out.append(c)
    return out


def call(mod: sm.CompiledScoreMod, x: torch.Tensor, h: int, grad: bool = True,
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled function on row ``x`` (keys 0..n-1) for head ``h``: (values, d/d score)."""
    c = mod.bind() if hasattr(mod, "bind") else mod          # (before 0.x: one shared binding)
    y, dy = x.clone().to(mod.dtype), torch.zeros(len(x), dtype=mod.dtype)
    ROW_FN(c.address)(y.data_ptr(), dy.data_ptr() if grad else None, len(x), 0, h, 0, 0,
                   c.caps_address, 1.0)
    c.check()
    return y, dy


def mismatches(got: torch.Tensor, want: torch.Tensor, approx: bool,
               dtype: torch.dtype) -> torch.Tensor:
    """Rows where ``got`` is not ``want``: bit for bit (NaN = NaN), or within ULPS ulp."""
    same = (got == want) | (got.isnan() & want.isnan())
    if approx:
        eps, tiny = EPS.get(dtype, EPS[torch.float32]), TINY.get(dtype, 1e-37)
        same |= (got - want).abs() <= ULPS * eps * want.abs() + tiny
    return torch.nonzero(~same).flatten()


def close(got: torch.Tensor, want: torch.Tensor, approx: bool, dtype: torch.dtype,
          what: str, case: Case, channel: int) -> None:
    """``got`` is torch's ``want`` on the whole row — or, where torch's vector path rounds
    otherwise than its scalar one (float16 ``//``, float32 ``** 1.0006``), torch's result
    for that one score (0-d operands: the score_mod's own semantics)."""
    rows = mismatches(got, want, approx, dtype)
    if len(rows):
        one = channels(case.per_score(rows.tolist()), dtype)[channel]
        rows = rows[mismatches(got[rows], one, approx, dtype)][:6].tolist()
        assert not rows, (f"{what}: rows {rows}: got {got[rows].tolist()}, torch "
                          f"{want[rows].tolist()}")


def check_cases(compiled: sm.CompiledScoreMod, picks: list[tuple[Case, int]]) -> None:
    for j, (c, i) in enumerate(picks):
        r, g = c.reference()
        want = channels(r, r.dtype)[i]
        y, dy = call(compiled, c.x.double(), j)
        approx = c.name in APPROX
        what = f"{c.name}({c.da}{'' if c.db is None else ', ' + str(c.db)}) channel {i}"
        close(y, want, approx, r.dtype, what, c, i)
        low = {torch.float16, torch.bfloat16} & {c.da, c.db, r.dtype}
        if g is not None and i == 0 and not (low and c.db is not None):
            # d/d score where torch's is finite. torch differentiates in reverse, rounding
            # d out / d node to each node's dtype (and pow's exponent - 1 to the exponent's);
            # the kernel forward, rounding d node / d score: the same formulas, rounded
            # otherwise — compared for float16 / bfloat16 with one operand only
            ok = g.isfinite() & c.x.isfinite()
            tol = 64 * max(EPS.get(d, 0.0) for d in (r.dtype, c.da, c.db))
            scale = g[ok].abs().max().item() if ok.any() else 0.0
            torch.testing.assert_close(dy[ok], g[ok], rtol=tol, atol=tol * scale,
                                       equal_nan=True,
                                       msg=lambda m, w=what: f"{w} derivative: {m}")


_GROUPS: dict[str, list[Case]] = {}


def groups() -> dict[str, list[Case]]:
    """Each dtype's unary and same-dtype binary ops, and the mixed pairs' binary ops."""
    if not _GROUPS:
        for d in DTYPES:
            _GROUPS[str(d)[6:]] = cases_for(d, None, UNARY) + cases_for(d, d, BINARY)
        for pairs in (MIXED[:4], MIXED[4:8], MIXED[8:]):
            _GROUPS["+".join(f"{str(a)[6:]}|{str(b)[6:]}" for a, b in pairs)] = [
                c for a, b in pairs for c in cases_for(a, b, {k: BINARY[k] for k in MIXED_OPS})]
        for cases in _GROUPS.values():
            for c in cases:
                c.rdtype = c.apply(*c.operands(torch.zeros(()), torch.zeros((), dtype=torch.long))
                                   ).dtype
                c.pad(max(c.n for c in cases))
    return _GROUPS


Built = dict[str, tuple[sm.CompiledScoreMod, list[tuple[Case, int]], dict[str, str]]]


def build(cases: list[Case]) -> tuple[sm.CompiledScoreMod, list[tuple[Case, int]],
                                      dict[str, str]]:
    """The chain of ``cases`` compiled, its picks, and the cases the compiler refused (why)."""
    refused: dict[str, str] = {}
    if compiles(*cases) is not None:                        # which: one trace per case
        refused = {f"{c.name}({c.da}, {c.db})": w for c in cases if (w := compiles(c))}
        cases = [c for c in cases if f"{c.name}({c.da}, {c.db})" not in refused]
    mod, picks = chain(cases)
    return sm.compile_score_mod(mod, dtype=F64, grad=False), picks, refused


@pytest.fixture(scope="module")
def built() -> Built:
    """Every group's chain, built two at a time (2 cores)."""
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(groups(), pool.map(build, groups().values()), strict=True))


@pytest.mark.parametrize("group", list(groups()))
def test_every_op_and_dtype_matches_torch(group: str, built: Built) -> None:
    compiled, picks, _ = built[group]
    assert len(picks) > 20, [c.name for c, _ in picks]
    check_cases(compiled, picks)


def test_every_op_torch_runs_here_compiles(built: Built) -> None:
    refused = {g: r for g, (_, _, r) in built.items() if r}
    assert not refused, refused


# ---------------------------------------------------------------- what is refused, and why
def test_a_captured_0d_tensor_promoting_only_per_score_is_refused() -> None:
    """``int32 * torch.tensor(3)``: per score (0-d, the trace) int64; torch's batched
    evaluation keeps int32 (a 0-d tensor does not promote a dimensioned one) and wraps. The
    compiler refuses it, so the call runs on the Python path and agrees with the reference."""
    big = torch.tensor(2**40)
    table = torch.arange(64, dtype=torch.int32) * 1000003

    def mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return score + ((table[kv_idx] * big) % 1000).float() * 1e-3

    why = sm.for_problem(mod, torch.float32)
    assert isinstance(why, str) and "0-d" in why, why
    q, k, v = torch.randn(1, 2, 9, 8), torch.randn(1, 2, 64, 8), torch.randn(1, 2, 64, 8)
    torch.testing.assert_close(ak.attention(q, k, v, score_mod=mod, backend="tiled"),
                               ak.attention(q, k, v, score_mod=mod, backend="reference"))
    same = torch.tensor(3, dtype=torch.int32)               # same dtype: nothing to refuse
    assert not isinstance(sm.for_problem(lambda s, b, h, q, kv: s + table[kv] * same,
                                         torch.float32), str)


def test_integer_division_by_zero_raises_as_torch_does() -> None:
    def mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return score + (q_idx // (kv_idx - 3)).float()      # kv_idx = 3: torch raises

    compiled = sm.compile_score_mod(mod, dtype=F64, grad=False)
    call(compiled, torch.zeros(3, dtype=F64), 0)             # keys 0..2: fine
    with pytest.raises(IndexError, match="divided an integer by zero"):
        call(compiled, torch.zeros(5, dtype=F64), 0)


def test_casts_of_a_whole_captured_tensor_convert_each_value_read() -> None:
    """``table.to(x.dtype)[kv]`` (a cast the trace cannot fold: the dtype is per-score) rounds
    or wraps each value read as torch's cast of the whole tensor does, cast after cast."""
    n = min(len(FLOAT_EDGES), len(INT_EDGES))
    table, ints = torch.tensor(FLOAT_EDGES[:n], dtype=F64), torch.tensor(INT_EDGES[:n])

    def mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        half, small = score.half().dtype, kv_idx.to(torch.int8).dtype
        return (table.to(half)[kv_idx].double() + table.to(half).to(torch.bfloat16)[kv_idx]
                + ints.to(small)[kv_idx] + table.to(small)[kv_idx])

    want = (table.half().double() + table.half().bfloat16().double() + ints.to(torch.int8)
            + table.to(torch.int8))
    y, _ = call(sm.compile_score_mod(mod, dtype=F64, grad=False), torch.zeros(n, dtype=F64), 0)
    rows = mismatches(y, want, False, F64)
    assert not len(rows), (rows, y[rows], want[rows])


def test_captured_tensors_are_read_in_their_own_dtype() -> None:
    """Captured tables of every dtype (float16 / bfloat16 by their bits, bool as bytes),
    read in place: each value read equals torch's."""
    tables = [torch.tensor(edges(d)).to(d) for d in DTYPES]
    n = min(len(t) for t in tables)

    def mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        out = torch.zeros((), dtype=F64)
        for i, t in enumerate(tables):
            out = torch.where(h == i, t[kv_idx].double(), out)
        return out

    compiled = sm.compile_score_mod(mod, dtype=F64, grad=False)
    for i, t in enumerate(tables):
        y, _ = call(compiled, torch.zeros(n, dtype=F64), i)
        rows = mismatches(y, t[:n].double(), False, F64)
        assert not len(rows), (DTYPES[i], rows, y[rows], t[rows])


# ---------------------------------------------------------------- positions: int32 and int64
# Rows whose b, h, q and keys are below codegen.POSITION_LIMIT (2^24) run the narrow variant
# (int64 position arithmetic held in int32 where its interval fits: AVX2 vectorises it); the
# others the wide one. Both must give torch's int64 results: beside the limit, across it, and
# far beyond it (|q - kv| small at 2^40, sums past 2^31, products past 2^53).
M = 40
SLOPES32 = torch.tensor([0.5, 0.25, 0.125, 0.0625])
TABLE = torch.randn(4, 2 * M + 1, generator=torch.Generator().manual_seed(7)).double()
IDS = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3], dtype=torch.int32)
POSITION_MODS: dict[str, Callable] = {
    "alibi": lambda s, b, h, q, kv: s - SLOPES32[h] * (q - kv),
    "abs_sqrt": lambda s, b, h, q, kv: s - 0.02 * (q - kv).abs().to(s.dtype).sqrt(),
    "sum_past_int32": lambda s, b, h, q, kv: s + (q + kv).to(s.dtype) * 1e-9,
    "product": lambda s, b, h, q, kv: s + (q * kv % 1000003).to(s.dtype) + (q * kv).to(s.dtype),
    "clamped_table": lambda s, b, h, q, kv: s + TABLE[h, (q - kv).clamp(-M, M) + M].to(s.dtype),
    "blocks": lambda s, b, h, q, kv: (s + ((q // 64) == (kv // 64)).to(s.dtype)
                                      + (kv % 7 - torch.fmod(kv - q, 5)).to(s.dtype)
                                      + (torch.div(q - kv, -3, rounding_mode="trunc") * 2
                                         ).to(s.dtype)),
    "where_minmax": lambda s, b, h, q, kv: torch.where(
        q >= kv, s, s - torch.maximum(kv - q, b - h * 3).to(s.dtype)) + torch.minimum(
        (q - kv).relu() * 5, torch.full_like(q, 100)).to(s.dtype),
    "casts_bits": lambda s, b, h, q, kv: (s + (q - kv).int().to(s.dtype)
                                          + (q - kv).to(torch.int16).to(s.dtype)
                                          + ((kv & 255) ^ (q | 3)).to(s.dtype)
                                          + (~(q - kv)).sign().to(s.dtype)),
    "captured_int32": lambda s, b, h, q, kv: s + (IDS[kv % 8].long() * (q - kv)).to(s.dtype),
}
LIM = 2**24
ROWS = [(0, 3, 0, 0, 40), (1, 2, 37, 5, 60), (0, 1, LIM - 1, LIM - 40, 40),  # narrow
        (0, 1, LIM, LIM - 40, 40), (0, 0, 5, LIM - 20, 40),                    # just past
        (2, 3, 2**31 - 1, 2**31 - 20, 40), (0, 2, 2**40, 2**40 - 25, 50),       # far past
        (1, 1, 3, 2**32 - 7, 30), (0, 3, 2**33 + 1, 0, 30),   # |q - kv| past 2^32: no wrap
        (2**33, 1, 2**53 + 3, 2**53 - 10, 20)]


def call_at(mod: sm.CompiledScoreMod, x: torch.Tensor, b: int, h: int, q: int, k0: int,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled function on row ``x`` of keys k0 .. k0 + n - 1: (values, d / d score)."""
    c = mod.bind()
    y, dy = x.clone().to(mod.dtype), torch.zeros(len(x), dtype=mod.dtype)
    call_row(c.address, c.caps_address, y, dy, b, h, q, k0)
    c.check()
    return y, dy



def generated(fn: Callable, dtype: torch.dtype) -> str:
    from attnkit.backends.native import codegen

    gm, ex = sm._trace(fn, dtype)
    wide, narrow = Gen(gm, ex, True, dtype), Gen(gm, ex, True, dtype, codegen.POSITION_LIMIT)
    return codegen.source(wide, wide.run(), (narrow, narrow.run()))


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("name", list(POSITION_MODS))
def test_positions_in_int32_and_int64_give_torchs_results(name: str, dtype: torch.dtype,
                                                           ) -> None:
    fn = POSITION_MODS[name]
    compiled = sm.compile_score_mod(fn, dtype=dtype, grad=True)
    g = torch.Generator().manual_seed(8)
    for b, h, q, k0, n in ROWS:
        x = torch.randn(n, generator=g, dtype=dtype)
        y, dy = call_at(compiled, x, b, h, q, k0)
        want, dwant = torch_row(fn, x, b, h, q, k0)
        # torch's own sqrt is not correctly rounded on every CPU (float32; float64 too on an
        # Intel Xeon with AVX-512: torch gives sqrt(32.0) one ulp low), the kernel's is
        approx = name == "abs_sqrt"
        rows = mismatches(y, want, approx, dtype)
        assert not len(rows), (name, (b, h, q, k0), rows.tolist(), y[rows].tolist(),
                               want[rows].tolist())
        torch.testing.assert_close(dy, dwant, rtol=0, atol=0)


def test_position_arithmetic_is_held_in_int32_below_the_limit() -> None:
    """The narrow variant computes ALiBi's and the user score_mod's positions in int32
    (int64 -> float has no AVX2 instruction), the wide one in int64; a product that can
    pass int32 stays int64 in both; a score-only function has one variant."""
    for name in ("alibi", "abs_sqrt", "clamped_table", "blocks"):
        src = generated(POSITION_MODS[name], torch.float32)
        wide, narrow = src.split("static inline int ak_rows_n(")
        body = narrow.split('extern "C"')[0]
        assert "const int32_t v0 = " in body and "int64_t v" not in body, (name, body)
        assert "const int64_t v0 = " in wide.split("static inline int ak_rows(")[1]
        assert f"n <= INT64_C({2**24}) - k0" in src
    prod = generated(POSITION_MODS["product"], torch.float32).split("ak_rows_n(")[1]
    assert "const int64_t v0 = (((int64_t)(q)) * ((int64_t)(kv)));" in prod
    gm, _ = sm._trace(lambda s, b, h, q, kv: torch.tanh(s), torch.float32)
    from attnkit.backends.native.codegen import uses_positions
    assert not uses_positions(gm)
