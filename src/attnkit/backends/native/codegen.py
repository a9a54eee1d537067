"""C++ source for a traced score_mod (``score_mod.py`` traces, builds and loads it).

:class:`Gen` walks the ``torch.fx`` graph of ``score_mod(score, b, h, q_idx, kv_idx)``
(0-d arguments: per-score semantics) with each node's example value (its dtype), and emits
one C++ statement per node: the value, and — for floating nodes that depend on the score —
its derivative by the score (forward mode, torch's conventions). :func:`source` wraps the
statements in the loop ``attnkit_mod`` runs over one row of keys (see ``score_mod.py``).

Shape legend::

    s, ts           the score (S: float, or double for float64 inputs) and its derivative by
                    itself (1)
    b, h, q, kv     int64 indices (int32 in the narrow variant); kv = k0 + j for key j
    vN, tN          node N's value and derivative        cN  captured tensor N (flat, C order)

Caution
-------
- Two variants of the loop: the wide one (int64 nodes in int64, valid for any position) and,
  when the score_mod reads b, h, q_idx or kv_idx, the narrow one (``Gen(limit=...)``), which
  the generated function runs while b, h, q and every key are below ``POSITION_LIMIT``
  (2^24): there each int64 node whose interval (followed from the positions' bounds, the
  literals and the captured dtypes) fits int32 is computed in int32 — the same values, so the
  same results, in the lanes AVX2 has (its int64 -> float conversion is scalar).
  ``source(..., wide=False)`` builds the narrow one alone (calls that never pass the limit).
- The file includes ``<climits>`` and ``<cstdint>`` only: ``akm::`` stands in for
  ``<cmath>`` (the same builtins libstdc++ calls) and ``<type_traits>``, whose parsing was
  half of each build.
- Every node computes what torch computes for it (the table test,
  ``tests/backends/test_native_score_mod_ops.py``, compares each op and dtype to torch):
  float32 / float64 nodes in float / double; float16 / bfloat16 nodes in float, each result
  (and derivative) rounded to its format (round-to-nearest-even), operands of another dtype
  rounded first, except a Python number in ``* / //`` (torch keeps those in float);
  integer nodes in their own width (int8 / int16 / int32 / uint8 / int64 wrap in two's
  complement, as torch; built with ``-fwrapv``); bool as bool. Integer ``//`` and ``%`` go
  through double (the loops vectorise) and, where an int64 operand reaches 2^53, the row runs
  again with exact integer division. Float -> integer casts of NaN, ±inf or values out of range
  give what torch gives on x86-64 (int64 / int32: the minimum; narrower: through int32, uint8
  through int64). Transcendental functions (``exp``, ``log``, ``tanh``, ``sin``, ``pow``, ...)
  are within a few ulp of torch's, not bit-equal (torch's own differ between its vector and
  scalar paths, and even its float32 ``sqrt`` is not correctly rounded here): a float64 call
  whose score_mod computes such a function in float32 agrees with the float64 reference to
  float32 precision at that node.
- Distance tables (:func:`distance_tables`, narrow variant only): a node of the distance
  ``q_idx − kv_idx`` alone (with b, h and literals) that holds a costly function is read
  from a per-thread table over the distance, filled by the same statements (so the same
  values; ``-ffp-contract=off``) as rows ask for distances it lacks; a change of the
  thread's float mode (FTZ / DAZ / rounding) or of (b, h) where the table reads them starts
  it afresh. A fill that would read captured data or flag a row (an index, an integer
  division) is not made, nor more than four tables: those nodes stay per key.
- Any op outside ``_UNARY`` / ``_BINARY`` / the casts raises :class:`Unsupported`; so does a
  captured 0-d tensor whose type promotion with a per-score value differs between the 0-d
  trace and torch's batched evaluation (0-d tensors do not promote dimensioned ones there).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

__all__ = ["POSITION_LIMIT", "Gen", "Unsupported", "distance_tables", "source", "uses_positions"]


class Unsupported(Exception):
    """The score_mod cannot be compiled; the message says why."""


# ---------------------------------------------------------------- the graph's values
@dataclass
class _Val:
    """One value per score: a C expression (a variable or a literal) of ``ctype``; ``tan`` the
    variable holding its derivative by the score (None = 0). ``lit``: a Python number of the
    graph; ``const``: a captured 0-d tensor (the same for every score)."""

    code: str
    ctype: str
    dtype: torch.dtype | None = None
    tan: str | None = None
    lit: bool = False
    const: bool = False
    rng: tuple[int, int] | None = None   # an integer value's interval (None: its dtype's)


@dataclass
class _Part:
    """A captured tensor, some leading free dims indexed: ``idx[d]`` None = still free;
    ``casts`` the dtypes it was cast to, in order (applied per loaded value)."""

    cap: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    idx: list[_Val | None]
    casts: tuple[torch.dtype, ...] = field(default=())


@dataclass
class _Const:
    value: Any


_FLOAT = {torch.float32: "float", torch.float16: "float", torch.bfloat16: "float",
          torch.float64: "double"}
_INT = {torch.int8: "int8_t", torch.int16: "int16_t", torch.int32: "int32_t",
        torch.int64: "int64_t", torch.uint8: "uint8_t"}
_HALF = {torch.float16: "ak_f16", torch.bfloat16: "ak_bf16"}   # float -> the format, in float
# captured data as the kernel reads it: 4- and 8-byte dtypes in place, narrower ones widened
# per call (8- and 16-bit gathers, and float16's conversion, would not vectorise)
_STORE = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.int8: torch.int32,
          torch.int16: torch.int32, torch.uint8: torch.int32, torch.bool: torch.int32}
# float -> integer as torch on x86-64 (cvtt: out of range or NaN -> the minimum)
_F2I = {"int64_t": "ak_f2i64({})", "int32_t": "ak_f2i32({})",
        "int16_t": "((int16_t)ak_f2i32({}))", "int8_t": "((int8_t)ak_f2i32({}))",
        "uint8_t": "((uint8_t)ak_f2i64({}))"}


def _ctype(dtype: torch.dtype) -> str:
    if dtype in _FLOAT:
        return _FLOAT[dtype]
    if dtype == torch.bool:
        return "bool"
    if dtype in _INT:
        return _INT[dtype]
    raise Unsupported(f"dtype {dtype} has no C type here")


def _is_float(ct: str) -> bool:
    return ct in ("float", "double")


def _is_int(ct: str) -> bool:
    return ct in _F2I


def _literal(x: Any) -> _Val:
    if isinstance(x, bool):
        return _Val("true" if x else "false", "bool", torch.bool, lit=True,
                    rng=(int(x), int(x)))
    if isinstance(x, int):
        if not -2**63 <= x < 2**63:
            raise Unsupported(f"integer {x} does not fit int64")
        code = "INT64_MIN" if x == -2**63 else f"INT64_C({x})"
        return _Val(code, "int64_t", torch.int64, lit=True, rng=(x, x))
    if isinstance(x, float):
        if math.isnan(x):
            code = "(double)NAN"
        elif math.isinf(x):
            code = "(double)INFINITY" if x > 0 else "(-(double)INFINITY)"
        else:
            code = repr(x)
            code = code if ("e" in code or "." in code) else code + ".0"
        return _Val(code, "double", torch.float64, lit=True)
    raise Unsupported(f"argument {x!r} ({type(x).__name__}) is not a number")


def _cast(v: _Val, ct: str) -> str:
    """``v`` converted to C type ``ct`` as torch converts (wrapping, x86's float -> int)."""
    if v.ctype == ct:
        return v.code
    if ct == "bool":
        return f"({v.code} != 0)"
    if _is_float(v.ctype) and _is_int(ct):
        return _F2I[ct].format(v.code)
    return f"(({ct})({v.code}))"


def _conv(v: _Val, dtype: torch.dtype, ct: str | None = None) -> str:
    """``v`` converted to torch dtype ``dtype`` (float16 / bfloat16: rounded to the format);
    ``ct``: the C type an integer node computes in, where not its dtype's (int64 narrowed to
    int32, :meth:`Gen.work`)."""
    code = _cast(v, ct or _ctype(dtype))
    if dtype in _HALF and v.dtype != dtype:
        code = f"{_HALF[dtype]}({code})"
    return code


def _tan(v: _Val, ct: str) -> str | None:
    return None if v.tan is None else _cast(_Val(v.tan, v.ctype), ct)


def _sum(*terms: str | None) -> str | None:
    got = [t for t in terms if t is not None]
    return None if not got else "(" + " + ".join(got) + ")"


# ---------------------------------------------------------------- integer intervals
# The narrow variant (``Gen(limit=POSITION_LIMIT)``) knows b, h, q_idx, kv_idx < the limit and
# follows each integer node's interval (Python ints: exact); an int64 node whose interval
# fits int32 is computed and held in int32 — the same value, so every later op and
# conversion gives the same result, but in lanes AVX2 has (int64 -> float conversions, and
# int64 // through double, have no AVX2 instruction: such loops ran scalar).
POSITION_LIMIT = 1 << 24      # b, h, q, k0 + n up to this: the narrow variant (else the wide)
_I32 = (-2**31, 2**31 - 1)
_LIMITS = {torch.int8: (-2**7, 2**7 - 1), torch.int16: (-2**15, 2**15 - 1), torch.int32: _I32,
           torch.int64: (-2**63, 2**63 - 1), torch.uint8: (0, 255), torch.bool: (0, 1)}
Range = tuple[int, int]


def _within(r: Range | None, bounds: Range) -> bool:
    return r is not None and bounds[0] <= r[0] and r[1] <= bounds[1]


def _rng(v: _Val) -> Range | None:
    """An integer or bool value's interval (its dtype's whole range where not known);
    None for a float."""
    if _is_float(v.ctype) or v.dtype not in _LIMITS:
        return None
    return v.rng or _LIMITS[v.dtype]


def _wrapped(r: Range | None, dtype: torch.dtype) -> Range | None:
    """The interval of a node of integer ``dtype`` whose exact result lies in ``r`` (None:
    unknown): ``r`` where it fits the dtype, else the dtype's range (the value wraps)."""
    lim = _LIMITS.get(dtype)
    if lim is None:
        return None
    return r if _within(r, lim) else lim


def _hull(*rs: Range) -> Range:
    return min(r[0] for r in rs), max(r[1] for r in rs)


def _int_range(name: str, r: list[Range | None], kw: dict[str, Any]) -> Range | None:
    """Interval of an integer op's exact result from its operands' intervals ``r`` (None:
    a float operand); None where not bounded. ``kw``: clamp's bounds (``lo``, ``hi``)."""
    if name in _COMPARE or name in ("logical_and", "logical_or", "logical_xor", "not"):
        return (0, 1)
    if name == "clamp":
        lo, hi = kw.get("lo"), kw.get("hi")
        if r[0] is None or (kw.get("has_lo") and lo is None) or (kw.get("has_hi") and
                                                                  hi is None):
            return None
        a = r[0]
        if lo is not None:                                  # as applied: lo, then hi
            a = (max(a[0], lo[0]), max(a[1], lo[1]))
        if hi is not None:
            a = (min(a[0], hi[0]), min(a[1], hi[1]))
        return a
    if name in ("remainder", "fmod") and len(r) == 2 and r[1] is not None:
        mb = max(abs(r[1][0]), abs(r[1][1]))                # |a % b| < |b| (b = 0: 0)
        if name == "remainder":                             # b's sign
            if r[1][0] > 0:
                return (0, r[1][1] - 1)
            if r[1][1] < 0:
                return (r[1][0] + 1, 0)
            return (-max(mb - 1, 0), max(mb - 1, 0))
        if r[0] is None:
            return None
        m = min(max(mb - 1, 0), max(abs(r[0][0]), abs(r[0][1])))   # a's sign, |.| <= |a|
        return (0 if r[0][0] >= 0 else -m, 0 if r[0][1] <= 0 else m)
    if name in ("and", "bitwise_and") and len(r) == 2:    # a non-negative operand bounds it
        pos = [x for x in r if x is not None and x[0] >= 0]
        return (0, min(x[1] for x in pos)) if pos else None
    if any(x is None for x in r):
        return None
    if name in ("or", "xor", "bitwise_or", "bitwise_xor"):
        if all(x[0] >= 0 for x in r):
            return (0, 2 ** max(x[1] for x in r).bit_length() - 1)
        return None
    if len(r) == 1:
        (lo, hi), = r
        if name in _CASTS or name in _SAME or name in ("detach", "pos", "floor", "ceil",
                                                       "trunc", "round", "fill"):
            return lo, hi
        if name == "neg":
            return -hi, -lo
        if name in ("abs", "square"):
            m = (0 if lo <= 0 <= hi else min(abs(lo), abs(hi)), max(abs(lo), abs(hi)))
            return m if name == "abs" else (m[0] ** 2, m[1] ** 2)
        if name == "sign":
            return (lo > 0) - (lo < 0), (hi > 0) - (hi < 0)
        if name == "relu":
            return max(lo, 0), max(hi, 0)
        if name == "invert":
            return -hi - 1, -lo - 1
        return None
    if len(r) != 2:
        return None
    (a0, a1), (b0, b1) = r
    if name == "add":
        return a0 + b0, a1 + b1
    if name == "sub":
        return a0 - b1, a1 - b0
    if name == "rsub":
        return b0 - a1, b1 - a0
    if name == "mul":
        ps = [a0 * b0, a0 * b1, a1 * b0, a1 * b1]
        return min(ps), max(ps)
    if name in ("minimum", "fmin"):
        return min(a0, b0), min(a1, b1)
    if name in ("maximum", "fmax"):
        return max(a0, b0), max(a1, b1)
    if name in ("where", "masked_fill"):                   # the two values' hull
        return _hull((a0, a1), (b0, b1))
    if name in ("floor_divide", "trunc_divide", "div"):   # |a // b| <= |a| (b = 0: a)
        m = max(abs(a0), abs(a1))
        return -m, m
    return None


# name -> (value template, derivative template or None = 0); a = operand, y = the result,
# ta = the operand's derivative, T = the C type
_UNARY: dict[str, tuple[str, str | None]] = {
    "neg": ("(-{a})", "(-{ta})"), "pos": ("{a}", "{ta}"),
    "abs": ("ak_abs({a})", "(ak_sgn({a}) * {ta})"),
    "exp": ("ak_exp({a})", "({ta} * {y})"),
    "exp2": ("akm::exp2({a})", "({ta} * {y} * (T)0.6931471805599453)"),
    "expm1": ("akm::expm1({a})", "({ta} * ({y} + (T)1))"),
    "log": ("ak_log({a})", "({ta} / {a})"),
    "log2": ("akm::log2({a})", "({ta} / ({a} * (T)0.6931471805599453))"),
    "log10": ("akm::log10({a})", "({ta} / ({a} * (T)2.302585092994046))"),
    "log1p": ("akm::log1p({a})", "({ta} / ((T)1 + {a}))"),
    "sqrt": ("akm::sqrt({a})", "({ta} / ((T)2 * {y}))"),
    "rsqrt": ("((T)1 / akm::sqrt({a}))", "((T)-0.5 * {ta} * {y} * {y} * {y})"),
    "tanh": ("ak_tanh({a})", "({ta} * ((T)1 - {y} * {y}))"),
    "sigmoid": ("ak_sigmoid({a})", "({ta} * {y} * ((T)1 - {y}))"),
    "sin": ("akm::sin({a})", "({ta} * akm::cos({a}))"),
    "cos": ("akm::cos({a})", "(-{ta} * akm::sin({a}))"),
    "erf": ("akm::erf({a})", "({ta} * (T)1.1283791670955126 * akm::exp(-{a} * {a}))"),
    "reciprocal": ("((T)1 / {a})", "(-{ta} * {y} * {y})"),
    "relu": ("(({a} > (T)0 || {a} != {a}) ? {a} : (T)0)", "({y} > (T)0 ? {ta} : (T)0)"),
    "square": ("({a} * {a})", "((T)2 * {a} * {ta})"),
    "sign": ("ak_sgn({a})", None), "floor": ("akm::floor({a})", None),
    "ceil": ("akm::ceil({a})", None), "trunc": ("akm::trunc({a})", None),
    "round": ("akm::nearbyint({a})", None), "frac": ("({a} - akm::trunc({a}))", "{ta}"),
}
_INT_UNARY = {"neg", "pos", "abs", "sign", "square", "floor", "ceil", "trunc", "round", "relu"}
_ARITH = {"add", "sub", "rsub", "mul", "div", "floor_divide", "remainder", "fmod", "pow",
          "minimum", "maximum", "fmin", "fmax"}
_COMPARE = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
_LOGIC = {"logical_and": "&&", "logical_or": "||", "logical_xor": "!=", "and": "&",
          "or": "|", "xor": "^", "bitwise_and": "&", "bitwise_or": "|", "bitwise_xor": "^"}
_SHIFT = {"lshift": "ak_shl", "rshift": "ak_shr"}
_BINARY = _ARITH | set(_COMPARE) | set(_LOGIC) | set(_SHIFT)
# ops whose Python-number operand torch keeps in float for a float16 / bfloat16 tensor
# (its CPU kernels' scalar paths); every other op rounds it to the tensor's format first
_OPMATH_SCALAR = {"mul", "div", "floor_divide"}
_CASTS = {"to", "type", "type_as", "float", "double", "half", "bfloat16", "long", "int",
          "short", "bool", "char", "byte"}
_SAME = {"contiguous", "clone", "expand", "expand_as", "view", "view_as", "reshape",
         "reshape_as", "squeeze", "unsqueeze", "flatten", "broadcast_to"}
_ALIASES = {"absolute": "abs", "negative": "neg", "clip": "clamp", "true_divide": "div",
            "truediv": "div", "multiply": "mul", "subtract": "sub", "greater": "gt",
            "greater_equal": "ge", "less": "lt", "less_equal": "le", "not_equal": "ne",
            "sgn": "sign", "expit": "sigmoid", "floordiv": "floor_divide", "mod": "remainder",
            "and_": "and", "or_": "or", "__getitem__": "getitem", "logical_not": "not",
            "bitwise_not": "invert", "__and__": "and", "__or__": "or", "__xor__": "xor",
            "__invert__": "invert", "eq": "eq", "clamp_min": "clamp_min",
            "bitwise_left_shift": "lshift", "bitwise_right_shift": "rshift",
            "__lshift__": "lshift", "__rshift__": "rshift", "positive": "pos"}
_NAMES = (set(_UNARY) | _BINARY | _CASTS | _SAME | set(_ALIASES) | {
    "where", "masked_fill", "clamp", "clamp_min", "clamp_max", "full_like", "zeros_like",
    "ones_like", "detach", "getitem", "invert", "not"})


def _function_names() -> dict[int, str]:
    """id(callable) -> op name for torch / torch.special / F / operator functions."""
    out: dict[int, str] = {}
    mods = (torch, torch.special, torch.nn.functional, torch.Tensor, operator)
    for mod in mods:
        for name in _NAMES:
            f = getattr(mod, name, None)
            if callable(f) and id(f) not in out:
                out[id(f)] = name
    out[id(getattr)] = "getattr"
    return out


_FUNCS: dict[int, str] | None = None


def _op_name(node: fx.Node) -> str:
    global _FUNCS
    if node.op == "call_method":
        name = str(node.target)
    else:
        if _FUNCS is None:
            _FUNCS = _function_names()
        name = _FUNCS.get(id(node.target), "")
        if not name:
            raise Unsupported(f"call of {getattr(node.target, '__name__', node.target)!r} "
                              "is not an elementwise op the native score_mod knows")
    name = _ALIASES.get(name, name)
    if name.startswith("__") and name.endswith("__"):
        name = _ALIASES.get(name, name.strip("_"))
    if name.endswith("_") and name not in ("and_", "or_"):
        raise Unsupported(f"in-place op {name!r}")
    return {"and_": "and", "or_": "or"}.get(name, name)


# ---------------------------------------------------------------- distance tables
# A node that reads the positions only through q_idx − kv_idx (with b, h, literals: no score,
# no captured data) has one value per distance t = kv − q. In the narrow variant such nodes
# whose computation holds a costly function (sqrt, log, exp, ...) are read from per-thread
# tables over t, computed as rows ask for distances not in them yet: a causal call over 4096
# keys asks ~8k distances per thread for its 16.8M scores, and later calls none. The table
# runs the same C statements, so it holds the same values (the build contracts no FMA).
_MAX_TABLES = 4          # tables per score_mod (each AK_CAP values per thread: 64 KB float)
_COSTLY = {"exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "tanh",
           "sigmoid", "sin", "cos", "erf", "pow"}


@dataclass
class _Tables:
    """The graph's distance tables (:func:`distance_tables`): ``sign`` each ``q_idx −
    kv_idx`` node (−1: it is −t) or ``kv_idx − q_idx`` (+1); ``tabled`` the nodes read from
    a table (costly, of t, b, h and literals alone, and used by a node that is not);
    ``fill`` the nodes they are computed from (the tables' fill); ``skip`` the nodes of t
    that only tabled ones need (not computed per key); ``keyed`` whether the tables depend
    on (b, h)."""

    sign: dict[fx.Node, int]
    tabled: list[fx.Node]
    fill: set[fx.Node]
    skip: set[fx.Node]
    keyed: tuple[bool, bool]


def distance_tables(gm: fx.GraphModule) -> _Tables | None:
    """The distance tables worth having in ``gm`` (a traced score_mod), or None."""
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(ph) != 5:
        return None
    q, kv = ph[3], ph[4]
    deps: dict[fx.Node, frozenset[str]] = dict(zip(ph, map(frozenset, "sbhqk"), strict=True))
    sign: dict[fx.Node, int] = {}
    costly: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            deps[n] = frozenset("c")
        elif n.op in ("call_function", "call_method"):
            try:
                name = _op_name(n)
            except Unsupported:
                return None
            if name == "getattr":                           # x.dtype and the like
                deps[n] = frozenset()
            elif name == "sub" and not n.kwargs and len(n.args) == 2 and \
                    {id(a) for a in n.args} == {id(q), id(kv)}:
                sign[n] = -1 if n.args[0] is q else 1
                deps[n] = frozenset("t")
            else:
                deps[n] = frozenset().union(*(deps[x] for x in n.all_input_nodes))
                if name in _COSTLY:
                    costly.add(n)
    local = {n for n, d in deps.items() if n.op != "placeholder" and d <= frozenset("tbh")}
    heavy: set[fx.Node] = set()
    for n in gm.graph.nodes:                                # (in order: inputs first)
        if n in local and "t" in deps[n] and (
                n in costly or any(x in heavy for x in n.all_input_nodes)):
            heavy.add(n)
    tabled = [n for n in gm.graph.nodes if n in heavy and any(u not in local for u in n.users)]
    if not tabled or len(tabled) > _MAX_TABLES:
        return None
    fill = _inputs_of(tabled, lambda x: x in local)         # what the tabled nodes read
    need = _inputs_of([x for n in gm.graph.nodes if n not in local for x in n.all_input_nodes],
                      lambda x: x not in tabled)            # computed per key all the same
    skip = {n for n in local if "t" in deps[n] and n not in need and n not in tabled}
    keyed = (any("b" in deps[n] for n in tabled), any("h" in deps[n] for n in tabled))
    return _Tables(sign, tabled, fill, skip, keyed)


def _inputs_of(start: list[fx.Node], keep: Any) -> set[fx.Node]:
    """``start`` and the nodes they read, transitively, walking only through nodes ``keep``
    accepts."""
    got: set[fx.Node] = set()
    todo = list(start)
    while todo:
        x = todo.pop()
        if x not in got and keep(x):
            got.add(x)
            todo.extend(x.all_input_nodes)
    return got


# ---------------------------------------------------------------- code generation
class Gen:
    """``score_dtype``: float32 (the kernel's float rows, for float32 / bfloat16 / float16
    inputs) or float64 (its double rows). After :meth:`run`: ``caps`` the captured tensors
    (the graph's own objects: their data is read at each call), ``cap_stores`` the dtype the
    kernel reads each as, ``exact`` whether a row may need its exact (integer-division)
    rerun. ``limit``: the narrow variant, valid while b, h, q_idx, kv_idx < ``limit`` (their
    int64 nodes in int32 where their intervals fit, see ``POSITION_LIMIT``); None: the wide
    one, valid everywhere."""

    def __init__(self, gm: fx.GraphModule, examples: dict[fx.Node, Any], grad: bool,
                 score_dtype: torch.dtype = torch.float32, limit: int | None = None,
                 tables: _Tables | None = None) -> None:
        self.gm, self.ex, self.grad = gm, examples, grad
        self.score_dtype = score_dtype
        self.limit = limit
        # distance tables (the narrow variant only; dropped by run() where the fill would
        # read captured data or flag a row): their values' statements and results
        self.tables = tables if limit is not None else None
        self.table_lines: list[tuple[bool, str]] = []
        self.table_vals: list[_Val] = []
        self.score_ct = _ctype(score_dtype)
        self.lines: list[tuple[bool, str]] = []      # (is a derivative line, C statement)
        self.caps: list[torch.Tensor] = []
        self.cap_stores: list[torch.dtype] = []
        self.cap_types: list[str] = []
        self.exact = False
        self.flags = False           # a statement may set the row's bad (an index, a //)
        self.n = 0

    def new(self, ct: str, expr: str, tangent: bool = False) -> str:
        name = f"{'t' if tangent else 'v'}{self.n}"
        self.n += 1
        self.lines.append((tangent, f"const {ct} {name} = {expr};"))
        return name

    def value(self, ct: str, dtype: torch.dtype, expr: str, tan: str | None) -> _Val:
        v = self.new(ct, expr)
        t = self.new(ct, tan, tangent=True) if (tan is not None and _is_float(ct)) else None
        return _Val(v, ct, dtype, t)

    def narrow(self, r: Range | None) -> bool:
        """Whether an int64 value of interval ``r`` is held in int32 (the narrow variant)."""
        return self.limit is not None and _within(r, _I32)

    def work(self, dtype: torch.dtype, r: Range | None, operands: list[_Val]) -> str:
        """The C type an integer node of ``dtype`` and interval ``r`` computes in: int32_t
        for an int64 node of the narrow variant whose integer operands and result all fit
        int32 (no op can overflow there), else its dtype's own."""
        ct = _ctype(dtype)
        if ct == "int64_t" and self.narrow(r) and all(
                self.narrow(_rng(v)) for v in operands if not _is_float(v.ctype)):
            return "int32_t"
        return ct

    def held(self, v: Any, r: Range | None) -> Any:
        """An integer node's value with its interval ``r``; an int64 one computed in int64
        whose interval fits int32 (``clamp(table[kv], 0, 99)``) is then held in int32."""
        if not isinstance(v, _Val) or _is_float(v.ctype):
            return v
        v.rng = r
        if v.ctype == "int64_t" and self.narrow(r):
            return _Val(self.new("int32_t", f"((int32_t)({v.code}))"), "int32_t", v.dtype, rng=r)
        return v

    def int_operands(self, name: str, args: tuple, kwargs: dict,
                     ) -> tuple[list[_Val], dict[str, Any]]:
        """The operands an integer node's interval (and C type) depends on, and clamp's
        bounds (for :func:`_int_range`)."""
        kw: dict[str, Any] = {}
        if name in ("full_like", "zeros_like", "ones_like"):
            fill = {"zeros_like": 0, "ones_like": 1}.get(name)
            return [self.operand(args[1] if fill is None else fill)], kw
        if name == "where":
            return [self.operand(x) for x in args[1:3]], kw
        if name == "masked_fill":
            return [self.operand(args[0]), self.operand(args[2])], kw
        if name in ("clamp", "clamp_min", "clamp_max"):
            lo, hi = self.clamp_bounds(name, args, kwargs)
            for key, x in (("lo", lo), ("hi", hi)):
                if x is not None:
                    kw["has_" + key] = True
                    kw[key] = _rng(self.operand(x))
            return [self.operand(args[0])] + [self.operand(x) for x in (lo, hi)
                                              if x is not None], kw
        if name in _BINARY:
            return [self.operand(args[0]), self.operand(args[1])], kw
        return [self.operand(args[0])], kw

    def rounded(self, v: _Val) -> _Val:
        """A float16 / bfloat16 node's value (and derivative) rounded to its format."""
        f = _HALF[v.dtype]                                           # type: ignore[index]
        t = None if v.tan is None else self.new("float", f"{f}({v.tan})", tangent=True)
        return _Val(self.new("float", f"{f}({v.code})"), "float", v.dtype, t)

    def capture(self, t: torch.Tensor) -> _Part | _Val:
        if not isinstance(t, torch.Tensor) or t.is_complex() or t.device.type != "cpu":
            raise Unsupported(f"captured {type(t).__name__} {getattr(t, 'dtype', '')} "
                              f"{getattr(t, 'device', '')} (a CPU real tensor is needed)")
        if self.grad and t.requires_grad:
            raise Unsupported(f"captured tensor of shape {tuple(t.shape)} requires grad (the "
                              "native kernel differentiates the score only)")
        _ctype(t.dtype)                                         # a dtype the kernel has
        store = _STORE.get(t.dtype, t.dtype)
        self.caps.append(t)
        self.cap_stores.append(store)
        self.cap_types.append(_ctype(store))
        part = _Part(len(self.caps) - 1, tuple(t.shape), t.dtype, [None] * t.dim())
        if t.dim() == 0:
            v = self.load(part)
            return _Val(v.code, v.ctype, v.dtype, const=True)
        return part

    def load(self, p: _Part) -> _Val:
        self.flags = True                           # (ak_idx: an index out of range)
        off, stride = [], 1
        small = math.prod(p.shape) < 2**31          # every offset fits int32
        for d in range(len(p.shape) - 1, -1, -1):
            ix: _Val = p.idx[d]                                      # type: ignore[assignment]
            if small and self.narrow(_rng(ix)):     # the narrow variant's int32 index
                i = self.new("int32_t", f"ak_idx32({_cast(ix, 'int32_t')}, "
                                        f"INT32_C({p.shape[d]}), bad)")
                off.append(f"{i} * INT32_C({stride})")
            else:
                i = self.new("int64_t", f"ak_idx({_cast(ix, 'int64_t')}, "
                                        f"INT64_C({p.shape[d]}), bad)")
                off.append(f"{i} * INT64_C({stride})")
            stride *= p.shape[d]
        addr = " + ".join(off) if off else "0"
        if stride < 2**31:          # clamped indices: the offset fits int32 (faster gathers)
            addr = f"(int32_t)({addr})"
        src = self.caps[p.cap].dtype
        raw = _Val(f"c{p.cap}[{addr}]", self.cap_types[p.cap])          # exact: a widening
        v = _Val(self.new(_ctype(src), _cast(raw, _ctype(src))), _ctype(src), src)
        for dt in p.casts:                                    # t.half().float()[i]: each cast
            if dt != v.dtype:
                v = _Val(self.new(_ctype(dt), _conv(v, dt)), _ctype(dt), dt)
        return v

    def index(self, p: _Part, index: Any) -> _Part | _Val:
        items = list(index) if isinstance(index, tuple) else [index]
        idx = list(p.idx)
        free = [d for d, x in enumerate(idx) if x is None]
        if len(items) > len(free):
            raise Unsupported(f"too many indices for a captured tensor of shape {p.shape}")
        for d, it in zip(free, items, strict=False):
            if isinstance(it, slice) and it == slice(None):
                continue
            if isinstance(it, _Const):
                it = it.value
            if isinstance(it, int) and not isinstance(it, bool):
                it = _literal(it)
            if not isinstance(it, _Val) or not _is_int(it.ctype) or it.dtype == torch.uint8:
                what = f"of dtype {it.dtype}" if isinstance(it, _Val) else repr(it)
                raise Unsupported(f"index {what} into a captured tensor (integer expressions "
                                  "of b, h, q_idx, kv_idx only; torch reads a uint8 index as a "
                                  "mask)")
            idx[d] = it
        q = _Part(p.cap, p.shape, p.dtype, idx, p.casts)
        return self.load(q) if all(x is not None for x in idx) else q

    def holders(self) -> list[_Val]:
        """The placeholders' values: the score, then b, h, q, kv."""
        pos = ("int64_t", None) if self.limit is None else ("int32_t", (0, self.limit - 1))
        return [_Val("s", self.score_ct, self.score_dtype, "ts")] + [
            _Val(n, pos[0], torch.int64, rng=pos[1]) for n in ("b", "h", "q", "kv")]

    def node(self, node: fx.Node, env: dict[fx.Node, Any]) -> Any:
        """The value of a get_attr or call node (its operands in ``env``)."""
        if node.op == "get_attr":
            return self.capture(getattr(self.gm, str(node.target)))
        args = fx.node.map_arg(node.args, lambda n: env[n])
        kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
        name = _op_name(node)
        got = self.call(name, args, kwargs, self.ex.get(node))
        if isinstance(got, _Val) and got.dtype in _HALF and name != "getitem":
            got = self.rounded(got)
        return got

    def fill(self, t: _Tables) -> list[_Val]:
        """Run as the tables' fill (a fresh Gen): ``t.fill``'s nodes with t (the distance
        kv − q, int32: the narrow variant's) → the tabled nodes' values; raises
        Unsupported where a statement would read captured data or flag the row."""
        assert self.limit is not None
        env: dict[fx.Node, Any] = dict(zip(
            [n for n in self.gm.graph.nodes if n.op == "placeholder"], self.holders(),
            strict=True))
        span = (-(self.limit - 1), self.limit - 1)
        for n in self.gm.graph.nodes:
            if n in t.sign:
                env[n] = _Val("t" if t.sign[n] > 0 else "(-t)", "int32_t", torch.int64, rng=span)
            elif n in t.fill:
                for x in n.all_input_nodes:       # (a getattr of a per-score value: its
                    env.setdefault(x, None)       # dtype is the example's, not read here)
                env[n] = self.node(n, env)
        vals = [env[n] for n in t.tabled]
        if self.caps or self.exact or self.flags or not all(isinstance(v, _Val) for v in vals):
            raise Unsupported("the distance table would read captured data or flag a row")
        return vals

    def run(self) -> _Val:
        t = self.tables
        if t is not None:
            try:
                fill = Gen(self.gm, self.ex, self.grad, self.score_dtype, self.limit)
                self.table_vals, self.table_lines = fill.fill(t), fill.lines
            except Exception:  # noqa: BLE001 — no table: every node per key, as before
                self.tables = t = None
        env: dict[fx.Node, Any] = {}
        holders = iter(self.holders())
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(holders)
            elif t is not None and node in t.skip:
                env[node] = None                  # only tabled nodes read it: not computed
            elif t is not None and node in t.tabled:
                k = t.tabled.index(node)
                v = self.table_vals[k]
                env[node] = _Val(self.new(v.ctype, f"ak_t{k}[j]"), v.ctype, v.dtype, rng=v.rng)
            elif node.op in ("get_attr", "call_function", "call_method"):
                env[node] = self.node(node, env)
            elif node.op == "output":
                out = fx.node.map_arg(node.args[0], lambda n: env[n])
                if isinstance(out, (int, float)):
                    out = _literal(float(out))
                if not isinstance(out, _Val) or not _is_float(out.ctype):
                    raise Unsupported("the score_mod does not return one float per score")
                return out
            else:
                raise Unsupported(f"graph node {node.op}")
        raise Unsupported("the trace has no output")

    def operand(self, x: Any) -> _Val:
        if isinstance(x, _Const):
            x = x.value
        if isinstance(x, _Val):
            return x
        if isinstance(x, _Part):
            raise Unsupported(f"arithmetic on a whole captured tensor of shape {x.shape} "
                              "(index it with b, h, q_idx, kv_idx first)")
        return _literal(x)

    def call(self, name: str, args: tuple, kwargs: dict, ex: Any) -> Any:  # noqa: C901
        if name == "getattr":
            if args[1] in ("dtype", "device", "shape", "ndim", "requires_grad", "is_cuda"):
                return _Const(ex)
            raise Unsupported(f"attribute {args[1]!r}")
        if name == "getitem":
            if isinstance(args[0], _Part):
                got = self.index(args[0], args[1])
                if isinstance(got, _Val) and not (isinstance(ex, torch.Tensor) and
                                                  ex.numel() == 1):
                    raise Unsupported(f"indexing a captured tensor of shape {args[0].shape} "
                                      "does not give one value per score here")
                return got
            raise Unsupported("indexing a per-score value (it is a single number)")
        if isinstance(args[0], _Part) and name in _CASTS | {"detach", "contiguous", "clone"}:
            p = args[0]
            dt = ex.dtype if isinstance(ex, torch.Tensor) else p.dtype
            return _Part(p.cap, p.shape, dt, p.idx, p.casts + ((dt,) if dt != p.dtype else ()))
        if not isinstance(ex, torch.Tensor) or ex.numel() != 1:
            raise Unsupported(f"{name} does not give one value per score "
                              f"(example: {type(ex).__name__} {getattr(ex, 'shape', '')})")
        dtype = ex.dtype
        ct = _ctype(dtype)
        if _is_float(ct):
            return self.elementwise(name, args, kwargs, ct, dtype)
        vals, kw = self.int_operands(name, args, kwargs)
        op = "fill" if name.endswith("_like") else (
            name if name != "clamp_min" and name != "clamp_max" else "clamp")
        r = _wrapped(_int_range(op, [_rng(v) for v in vals], kw), dtype)
        return self.held(self.elementwise(name, args, kwargs, self.work(dtype, r, vals), dtype),
                         r)

    def elementwise(self, name: str, args: tuple, kwargs: dict, ct: str,
                    dtype: torch.dtype) -> _Val:
        """One elementwise node of ``dtype``, computed in C type ``ct``."""
        if name in _CASTS or name in _SAME:
            a = self.operand(args[0])
            return self.value(ct, dtype, _conv(a, dtype, ct), _tan(a, ct))
        if name == "detach":
            a = self.operand(args[0])
            return self.value(ct, dtype, _conv(a, dtype, ct), None)
        if name in ("full_like", "zeros_like", "ones_like"):
            fill = {"zeros_like": 0, "ones_like": 1}.get(name)
            f = self.operand(args[1] if fill is None else fill)
            return self.value(ct, dtype, _conv(f, dtype, ct), None)
        if name in _UNARY or name in ("invert", "not"):
            return self.unary(name, self.operand(args[0]), ct, dtype, kwargs)
        if name in ("clamp", "clamp_min", "clamp_max"):
            return self.clamp(name, args, kwargs, ct, dtype)
        if name == "where":
            c, a, b = (self.operand(x) for x in args[:3])
            _same_promotion(name, [a, b], dtype)
            cc = _cast(c, "bool")
            t = None
            if a.tan or b.tan:
                t = f"({cc} ? {_tan(a, ct) or '(' + ct + ')0'} : {_tan(b, ct) or '(' + ct + ')0'})"
            return self.value(ct, dtype,
                              f"({cc} ? {_conv(a, dtype, ct)} : {_conv(b, dtype, ct)})", t)
        if name == "masked_fill":
            a, m, f = (self.operand(x) for x in args[:3])
            mc = _cast(m, "bool")
            t = None if a.tan is None else f"({mc} ? ({ct})0 : {_tan(a, ct)})"
            return self.value(ct, dtype,
                              f"({mc} ? {_conv(f, dtype, ct)} : {_conv(a, dtype, ct)})", t)
        if name in _BINARY:
            if kwargs.get("alpha", 1) != 1:
                raise Unsupported(f"{name} with alpha")
            a, b = self.operand(args[0]), self.operand(args[1])
            if name == "div" and kwargs.get("rounding_mode") is not None:
                name = {"floor": "floor_divide", "trunc": "trunc_divide"}[kwargs["rounding_mode"]]
            return self.binary(name, a, b, ct, dtype, args)
        raise Unsupported(f"op {name!r}")

    def unary(self, name: str, a: _Val, ct: str, dtype: torch.dtype, kwargs: dict) -> _Val:
        if kwargs.get("decimals"):
            raise Unsupported("round with decimals")
        if name in ("invert", "not"):
            if ct == "bool":
                return self.value(ct, dtype, f"(!{_cast(a, 'bool')})", None)
            return self.value(ct, dtype, f"(~{_conv(a, dtype, ct)})", None)
        if not _is_float(ct) and name not in _INT_UNARY:
            raise Unsupported(f"{name} on integers")
        val_t, tan_t = _UNARY[name]
        if not _is_float(ct) and name in ("floor", "ceil", "trunc", "round"):
            val_t = "{a}"
        ac = _conv(a, dtype, ct)
        y = self.new(ct, val_t.format(a=ac).replace("(T)", f"({ct})"))
        t = None
        if tan_t is not None and a.tan is not None and _is_float(ct):
            t = self.new(ct, tan_t.format(a=ac, y=y, ta=_tan(a, ct)).replace("(T)", f"({ct})"),
                         tangent=True)
        return _Val(y, ct, dtype, t)

    @staticmethod
    def clamp_bounds(name: str, args: tuple, kwargs: dict) -> tuple[Any, Any]:
        lo = kwargs.get("min", args[1] if len(args) > 1 and name != "clamp_max" else None)
        hi = kwargs.get("max", args[2] if len(args) > 2 else (
            args[1] if name == "clamp_max" and len(args) > 1 else None))
        return lo, hi

    def clamp(self, name: str, args: tuple, kwargs: dict, ct: str, dtype: torch.dtype) -> _Val:
        a = self.operand(args[0])
        lo, hi = self.clamp_bounds(name, args, kwargs)
        A = _conv(a, dtype, ct)
        code, conds, tan = A, [], _tan(a, ct)
        lo_v = None if lo is None else self.operand(lo)
        hi_v = None if hi is None else self.operand(hi)
        _same_promotion(name, [v for v in (a, lo_v, hi_v) if v is not None], dtype)
        if lo_v is not None:                             # NaN in a bound: NaN, as torch
            code = f"ak_clamp_lo<{ct}>({code}, {_conv(lo_v, dtype, ct)})"
            conds.append(f"{A} >= {_conv(lo_v, dtype, ct)}")
        if hi_v is not None:
            code = f"ak_clamp_hi<{ct}>({code}, {_conv(hi_v, dtype, ct)})"
            conds.append(f"{A} <= {_conv(hi_v, dtype, ct)}")
        t = None
        if _is_float(ct):
            parts = []
            if tan is not None:
                parts.append(f"(({' && '.join(conds) or 'true'}) ? {tan} : ({ct})0)")
            if lo_v is not None and lo_v.tan is not None:
                parts.append(f"({A} < {_conv(lo_v, dtype)} ? {_tan(lo_v, ct)} : ({ct})0)")
            if hi_v is not None and hi_v.tan is not None:
                parts.append(f"({A} > {_conv(hi_v, dtype)} ? {_tan(hi_v, ct)} : ({ct})0)")
            t = _sum(*parts)
        return self.value(ct, dtype, code, t)

    def binary(self, name: str, a: _Val, b: _Val, ct: str, dtype: torch.dtype,  # noqa: C901
               raw: tuple) -> _Val:
        if name in _COMPARE or name in ("logical_and", "logical_or", "logical_xor"):
            if name in _COMPARE:
                ex = [self.ex.get(x) if isinstance(x, fx.Node) else x for x in raw[:2]]
                cdt = torch.result_type(*[_example(e, v) for e, v in zip(ex, (a, b),
                                                                         strict=True)])
                _same_promotion(name, [a, b], cdt)
                cct = self.work(cdt, _I32, [a, b]) if not cdt.is_floating_point else None
                cmp = f"({_conv(a, cdt, cct)} {_COMPARE[name]} {_conv(b, cdt, cct)})"
            else:
                cmp = f"({_cast(a, 'bool')} {_LOGIC[name]} {_cast(b, 'bool')})"
            return self.value("bool", torch.bool, cmp, None)
        _same_promotion(name, [a, b], dtype)
        if name in _LOGIC or name in _SHIFT:
            if _is_float(ct):
                raise Unsupported(f"{name} on floats")
            if name in _SHIFT:
                if ct == "bool":
                    raise Unsupported(f"{name} of bools")
                return self.value(ct, dtype, f"{_SHIFT[name]}<{ct}>({_conv(a, dtype, ct)}, "
                                             f"{_conv(b, dtype, ct)})", None)
            op = {"and": "&&", "or": "||", "xor": "!="}.get(name) if ct == "bool" else None
            return self.value(ct, dtype, f"({_cast(a, ct)} {op or _LOGIC[name]} {_cast(b, ct)})",
                              None)
        keep = name in _OPMATH_SCALAR                      # a Python number stays in float
        A = _cast(a, ct) if keep and a.lit else _conv(a, dtype, ct)
        B = _cast(b, ct) if keep and b.lit else _conv(b, dtype, ct)
        ta, tb = (_tan(a, ct), _tan(b, ct)) if _is_float(ct) else (None, None)
        fl = _is_float(ct)
        if name == "rsub":
            a, b, A, B, ta, tb = b, a, B, A, tb, ta
            name = "sub"
        if name == "add":
            return self.value(ct, dtype, f"({A} + {B})", _sum(ta, tb))
        if name == "sub":
            neg = None if tb is None else f"(-{tb})"
            return self.value(ct, dtype, f"({A} - {B})", _sum(ta, neg))
        if name == "mul":
            return self.value(ct, dtype, f"({A} * {B})", _sum(
                None if ta is None else f"({ta} * {B})", None if tb is None else f"({A} * {tb})"))
        if name == "div":                                # torch's: g / b, -g * a / (b * b)
            return self.value(ct, dtype, f"({A} / {B})", _sum(
                None if ta is None else f"({ta} / {B})",
                None if tb is None else f"(-{tb} * {A} / ({B} * {B}))"))
        if name in ("floor_divide", "trunc_divide"):
            if fl:                                       # torch's rounding (from fmod)
                f = "ak_ffloordiv" if name == "floor_divide" else "ak_ftruncdiv"
                return self.value(ct, dtype, f"{f}({A}, {B})", None)
            f = "ak_floordiv" if name == "floor_divide" else "ak_truncdiv"
            return self.value(ct, dtype, self.intdiv(f, A, B, ct, dtype), None)
        if name in ("remainder", "fmod"):
            if not fl:
                f = "ak_mod" if name == "remainder" else "ak_fmod_i"
                return self.value(ct, dtype, self.intdiv(f, A, B, ct, dtype), None)
            if name == "remainder":                      # torch: fmod, moved to b's sign
                return self.value(ct, dtype, f"ak_fremainder({A}, {B})", _sum(
                    ta, None if tb is None else f"(-{tb} * ak_ffloordiv({A}, {B}))"))
            return self.value(ct, dtype, f"akm::fmod({A}, {B})",
                              _sum(ta, None if tb is None else f"(-{tb} * ak_ftruncdiv({A}, {B}))"))
        if name == "pow":
            if not fl:                                   # negative exponents: 0, or ±1
                return self.value(ct, dtype, f"ak_ipow({A}, {B})", None)
            e = _number(raw[1])
            forms = (1.0, 2.0, -1.0) if dtype == torch.float16 else (
                1.0, 2.0, 3.0, -1.0, -2.0, 0.5, -0.5)
            if e in forms:
                # torch's own forms for these exponents (products, a square root; float16:
                # std::pow but where that is exact; bfloat16: each product rounded): they
                # vectorise
                pos = A
                for _ in range(int(abs(e)) - 1):                 # type: ignore[arg-type]
                    pos = f"({pos} * {A})"
                    pos = f"ak_bf16({pos})" if dtype == torch.bfloat16 else pos
                pos = f"akm::sqrt({A})" if abs(e) == 0.5 else pos  # type: ignore[arg-type]
                y = self.new(ct, pos if e > 0 else f"(({ct})1 / {pos})")  # type: ignore[operator]
                d = (f"(({ct})0.5 / {y})" if e == 0.5 else
                     f"(({ct})-0.5 * {y} / {A})" if e == -0.5 else
                     f"(({ct}){e} * {y} / {A})" if e < 0 else  # type: ignore[operator]
                     f"(({ct}){int(e)}" + "".join(f" * {A}" for _ in range(int(e) - 1)) + ")")
                t = None if ta is None else self.new(ct, f"({ta} * {d})", tangent=True)
                return _Val(y, ct, dtype, t)
            if e is not None and dtype == torch.float32:      # torch: pow(float, double)
                y = self.new(ct, f"((float)akm::pow((double){A}, {_cast(b, 'double')}))")
            else:
                y = self.new(ct, f"akm::pow({A}, {B})")
            parts = []
            if ta is not None:                           # torch: the exponent as given
                E = _cast(b, ct) if b.lit else B
                parts.append(f"({E} == ({ct})0 ? ({ct})0 : "
                             f"{ta} * {E} * akm::pow({A}, {E} - ({ct})1))")
            if tb is not None:
                parts.append(f"(({A} == ({ct})0 && {B} >= ({ct})0) ? ({ct})0 : "
                             f"{tb} * {y} * akm::log({A}))")
            t = _sum(*parts)
            return _Val(y, ct, dtype, None if t is None else self.new(ct, t, tangent=True))
        if name in ("minimum", "maximum", "fmin", "fmax"):
            f = {"minimum": "ak_min", "maximum": "ak_max", "fmin": "akm::fmin",
                 "fmax": "akm::fmax"}[name]
            if not fl:                                   # integers: no NaN; exact in int64
                f = {"fmin": "ak_min", "fmax": "ak_max"}.get(name, f)
            t = None
            if ta is not None or tb is not None:
                za, zb = ta or f"({ct})0", tb or f"({ct})0"
                if name in ("minimum", "maximum"):      # torch: ties split, NaN feeds both
                    lt = "<" if name == "maximum" else ">"
                    gt = ">" if name == "maximum" else "<"
                    t = (f"({A} == {B} ? ({za} + {zb}) * ({ct})0.5 : "
                         f"(({A} {lt} {B} ? ({ct})0 : {za}) + ({A} {gt} {B} ? ({ct})0 : {zb})))")
                else:
                    ge = ">=" if name == "fmax" else "<="
                    t = f"(({A} {ge} {B} || {B} != {B}) ? {za} : {zb})"
            call = f"{f}<{ct}>" if f.startswith("ak_") else f
            return self.value(ct, dtype, f"{call}({A}, {B})", t)
        raise Unsupported(f"op {name!r}")

    def intdiv(self, f: str, A: str, B: str, ct: str, dtype: torch.dtype) -> str:
        """Integer // or %: through double, exact below 2^53 (int64 operands beyond set
        ``big``: the row runs again, exactly, see :func:`source`); an int64 node narrowed to
        int32 (operands and result within int32, never INT32_MIN // -1) by its int32 form."""
        self.flags = True
        if ct == "int32_t" and dtype == torch.int64:
            return f"{f}32({A}, {B}, bad)"
        self.exact |= ct == "int64_t"
        return f"{f}<E>({A}, {B}, bad, big)"


def _same_promotion(name: str, vals: list[_Val], dtype: torch.dtype) -> None:
    """Refuse an op whose operands promote differently per score (0-d, the trace) than in
    torch's batched evaluation, where a captured 0-d tensor does not promote a dimensioned
    per-score value of its own kind (``score * torch.tensor(2.0, dtype=torch.float64)``)."""
    if not any(v.const for v in vals) or all(v.const or v.lit for v in vals):
        return

    def stand_in(v: _Val) -> Any:
        if v.lit:
            return {torch.bool: False, torch.int64: 0}.get(v.dtype, 0.0)  # type: ignore[arg-type]
        return torch.zeros(() if v.const else (1,), dtype=v.dtype)

    got = stand_in(vals[0])
    for v in vals[1:]:
        other = stand_in(v)
        if isinstance(got, torch.Tensor) or isinstance(other, torch.Tensor):
            dim = any(isinstance(x, torch.Tensor) and x.dim() for x in (got, other))
            got = torch.zeros((1,) * dim, dtype=torch.result_type(got, other))
    batched = got.dtype if isinstance(got, torch.Tensor) else dtype
    if name == "div" and not batched.is_floating_point:         # int / int: float
        batched = torch.get_default_dtype()
    if batched != dtype:
        raise Unsupported(
            f"{name} of a captured 0-d tensor and a per-score value: per score (0-d) the "
            f"result is {dtype}, torch's batched evaluation gives {batched} (a 0-d tensor does "
            "not promote a dimensioned one): cast the captured tensor to the dtype you mean")


def _number(x: Any) -> float | None:
    """``x`` as a float when it is a Python number (a literal of the graph), else None."""
    if isinstance(x, _Const):
        x = x.value
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    return None


def _example(ex: Any, v: _Val) -> Any:
    """A value torch.result_type can take for an operand: its example, or a literal."""
    if isinstance(ex, (torch.Tensor, int, float, bool)):
        return ex
    if isinstance(ex, _Const):
        return ex.value
    return torch.zeros((), dtype=v.dtype or torch.float64)



_PRELUDE = r"""// generated by attnkit/backends/native/score_mod.py (codegen.py)
#include <climits>
#include <cstdint>
// No <cmath> / <type_traits>: parsing them took half the build (~0.2 s of ~0.4 s). akm:: holds
// what libstdc++'s <cmath> gives for float / double (the same builtins: the same code); any
// other argument goes through double, as <cmath>'s integer overloads do.
#define INFINITY (__builtin_inff())
#define NAN (__builtin_nanf(""))
namespace akm {
#define AK_MATH1(F)                                                                  \
  static inline float F(float a) { return __builtin_##F##f(a); }                    \
  static inline double F(double a) { return __builtin_##F(a); }                     \
  template <class T> static inline double F(T a) { return __builtin_##F((double)a); }
#define AK_MATH2(F)                                                                  \
  static inline float F(float a, float b) { return __builtin_##F##f(a, b); }        \
  static inline double F(double a, double b) { return __builtin_##F(a, b); }        \
  template <class T, class U> static inline double F(T a, U b) {                    \
    return __builtin_##F((double)a, (double)b);                                     \
  }
AK_MATH1(fabs) AK_MATH1(sqrt) AK_MATH1(exp) AK_MATH1(exp2) AK_MATH1(expm1) AK_MATH1(log)
AK_MATH1(log2) AK_MATH1(log10) AK_MATH1(log1p) AK_MATH1(tanh) AK_MATH1(sin) AK_MATH1(cos)
AK_MATH1(erf) AK_MATH1(floor) AK_MATH1(ceil) AK_MATH1(trunc) AK_MATH1(nearbyint)
AK_MATH2(fmod) AK_MATH2(pow) AK_MATH2(fmin) AK_MATH2(fmax) AK_MATH2(copysign)
#undef AK_MATH1
#undef AK_MATH2
// <type_traits>' make_signed / make_unsigned / is_signed for the integer C types used here
template <class T> struct sign_of;
#define AK_SIGN(T, S, U) template <> struct sign_of<T> { typedef S s; typedef U u; };
AK_SIGN(int8_t, int8_t, uint8_t) AK_SIGN(uint8_t, int8_t, uint8_t)
AK_SIGN(int16_t, int16_t, uint16_t) AK_SIGN(uint16_t, int16_t, uint16_t)
AK_SIGN(int32_t, int32_t, uint32_t) AK_SIGN(uint32_t, int32_t, uint32_t)
AK_SIGN(int64_t, int64_t, uint64_t) AK_SIGN(uint64_t, int64_t, uint64_t)
#undef AK_SIGN
template <class T> struct is_signed { static const bool value = (T)-1 < (T)0; };
}  // namespace akm
// integers wrap in their width (two's complement, as torch; built with -fwrapv)
template <class T> static inline T ak_abs(T a) { return a < (T)0 ? -a : a; }
static inline float ak_abs(float a) { return akm::fabs(a); }
static inline double ak_abs(double a) { return akm::fabs(a); }
template <class T> static inline T ak_sgn(T a) { return (T)((a > (T)0) - (a < (T)0)); }
template <class T> static inline T ak_max(T a, T b) {
  return a != a ? a : (b != b ? b : (a > b ? a : b));
}
template <class T> static inline T ak_min(T a, T b) {
  return a != a ? a : (b != b ? b : (a < b ? a : b));
}
// clamp's bounds, NaN in a or in a bound giving NaN (torch); lo > hi gives hi
template <class T> static inline T ak_clamp_lo(T a, T lo) {
  return a != a ? a : (lo != lo ? lo : (a < lo ? lo : a));
}
template <class T> static inline T ak_clamp_hi(T a, T hi) {
  return a != a ? a : (hi != hi ? hi : (a > hi ? hi : a));
}
// float -> float16 / bfloat16 -> float: round to nearest even (subnormals, overflow to inf,
// NaN kept), branch-free so loops vectorise
static inline float ak_f16(float x) {
  uint32_t u;
  __builtin_memcpy(&u, &x, 4);
  const uint32_t a = u & 0x7fffffffu, sign = u ^ a;
  float ax;
  __builtin_memcpy(&ax, &a, 4);
  const float sub = (ax + 0.5f) - 0.5f;                    // |x| < 2^-14: multiples of 2^-24
  uint32_t r = (a + 0x0fffu + ((a >> 13) & 1u)) & 0xffffe000u;
  float rf;
  __builtin_memcpy(&rf, &r, 4);
  float y = a < 0x38800000u ? sub : rf;
  y = a >= 0x477ff000u ? INFINITY : y;                     // >= 65520 rounds to inf
  uint32_t yu;
  __builtin_memcpy(&yu, &y, 4);
  yu = a > 0x7f800000u ? u : (yu | sign);
  float out;
  __builtin_memcpy(&out, &yu, 4);
  return out;
}
static inline float ak_bf16(float x) {
  uint32_t u;
  __builtin_memcpy(&u, &x, 4);
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  const uint32_t y = nan ? (u | 0x00400000u) & 0xffff0000u : r;
  float out;
  __builtin_memcpy(&out, &y, 4);
  return out;
}
// float -> int64 / int32 as torch on x86-64 (cvtt*: NaN, inf, out of range -> the minimum)
template <class F> static inline int64_t ak_f2i64(F x) {
  const bool ok = x >= (F)-9223372036854775808.0 && x < (F)9223372036854775808.0;
  return ok ? (int64_t)(ok ? x : (F)0) : INT64_MIN;
}
template <class F> static inline int32_t ak_f2i32(F x) {
  const bool ok = x >= (F)-2147483648.0 && x < (F)2147483648.0;
  return ok ? (int32_t)(ok ? x : (F)0) : INT32_MIN;
}
// << and >> as torch: a shift by < 0 or >= the width gives 0 (<<) or the sign (>>)
template <class T> static inline T ak_shl(T a, T b) {
  typedef typename akm::sign_of<T>::u U;
  typedef typename akm::sign_of<T>::s I;
  const bool out = (I)b < 0 || (int64_t)b >= (int64_t)sizeof(T) * 8;
  return out ? (T)0 : (T)((U)a << (out ? 0 : b));
}
template <class T> static inline T ak_shr(T a, T b) {
  const int64_t top = (int64_t)sizeof(T) * 8 - (akm::is_signed<T>::value ? 1 : 0);
  const bool out = (typename akm::sign_of<T>::s)b < 0 || (int64_t)b >= top;
  return (T)(a >> (out ? top : (int64_t)b));
}
// e^x in float, ~1 ulp, branch-free so loops vectorise (Cody-Waite, degree-6 polynomial;
// 2^n applied in two halves, so subnormal results and overflow to inf come out right)
static inline float ak_exp(float x) {
  const bool nan = x != x;
  const float c = nan ? 0.f : (x < -104.f ? -104.f : (x > 89.f ? 89.f : x));
  const float n = __builtin_rintf(c * 1.44269504088896341f);
  const float r = (c - n * 0.693359375f) - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  const int32_t ni = (int32_t)n, n1 = ni >> 1, n2 = ni - n1;
  const int32_t b1 = (n1 + 127) << 23, b2 = (n2 + 127) << 23;
  float p1, p2;
  __builtin_memcpy(&p1, &b1, 4);
  __builtin_memcpy(&p2, &b2, 4);
  const float e = y * p1 * p2;
  return nan ? x : (x < -104.f ? 0.f : e);
}
static inline double ak_exp(double x) { return akm::exp(x); }
// tanh in float: an odd polynomial below 0.625 (Cephes' tanhf), else 1 - 2 / (e^2|x| + 1)
static inline float ak_tanh(float x) {
  const float a = x < 0.f ? -x : x, z = x * x;
  float p = -5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const float big = 1.f - 2.f / (ak_exp(2.f * (a > 10.f ? 10.f : a)) + 1.f);
  return a < 0.625f ? p * z * x + x : (x < 0.f ? -big : big);
}
static inline double ak_tanh(double x) { return akm::tanh(x); }
// ln x in float, ~1 ulp, branch-free (Cephes' logf: mantissa in [sqrt(1/2), sqrt(2)),
// degree-8 polynomial; subnormals scaled by 2^23; 0 -> -inf, x < 0 -> NaN, inf -> inf)
static inline float ak_log(float x) {
  const bool sub = x < 1.17549435e-38f;
  const float xs = sub ? x * 8388608.f : x;
  int32_t i;
  __builtin_memcpy(&i, &xs, 4);
  int32_t e = ((i >> 23) & 0xff) - 126 - (sub ? 23 : 0);
  const int32_t mi = (i & 0x007fffff) | 0x3f000000;
  float m;
  __builtin_memcpy(&m, &mi, 4);                              // [0.5, 1)
  const bool lo = m < 0.707106781186547524f;
  e = lo ? e - 1 : e;
  const float t = lo ? m + m - 1.f : m - 1.f, z = t * t, fe = (float)e;
  float p = 7.0376836292e-2f;
  p = p * t - 1.1514610310e-1f;
  p = p * t + 1.1676998740e-1f;
  p = p * t - 1.2420140846e-1f;
  p = p * t + 1.4249322787e-1f;
  p = p * t - 1.6668057665e-1f;
  p = p * t + 2.0000714765e-1f;
  p = p * t - 2.4999993993e-1f;
  p = p * t + 3.3333331174e-1f;
  float y = t * z * p;
  y += -2.12194440e-4f * fe;
  y += -0.5f * z;
  float r = (t + y) + 0.693359375f * fe;
  r = x == 0.f ? -INFINITY : r;
  r = x < 0.f ? NAN : r;
  r = x == INFINITY ? x : r;
  return x != x ? x : r;
}
static inline double ak_log(double x) { return akm::log(x); }
// 1 / (1 + e^-x) through e = e^-|x| (both tails keep their relative accuracy)
template <class T> static inline T ak_sigmoid(T x) {
  const T e = ak_exp(x < (T)0 ? x : -x);
  return (x < (T)0 ? e : (T)1) / ((T)1 + e);
}
// float % and // as torch computes them: from the exact fmod (a - b * floor(a / b) loses
// the remainder once a / b rounds), the remainder moved to b's sign, the quotient rounded
template <class T> static inline T ak_fremainder(T a, T b) {
  const T m = akm::fmod(a, b);
  return (m != (T)0 && ((b < (T)0) != (m < (T)0))) ? m + b : m;
}
template <class T> static inline T ak_ffloordiv(T a, T b) {
  if (b == (T)0) return a / b;
  const T m = akm::fmod(a, b);
  T d = (a - m) / b;
  if (m != (T)0 && ((b < (T)0) != (m < (T)0))) d -= (T)1;
  if (d == (T)0) return akm::copysign((T)0, a / b);
  const T f = akm::floor(d);
  return d - f > (T)0.5 ? f + (T)1 : f;
}
template <class T> static inline T ak_ftruncdiv(T a, T b) { return akm::trunc(a / b); }
static inline int64_t ak_idx(int64_t i, int64_t size, int& bad) {
  i = i < 0 ? i + size : i;
  bad |= (i < 0) | (i >= size);
  return i < 0 ? 0 : (i >= size ? size - 1 : i);
}
static inline int32_t ak_idx32(int32_t i, int32_t size, int& bad) {
  i = i < 0 ? i + size : i;
  bad |= (i < 0) | (i >= size);
  return i < 0 ? 0 : (i >= size ? size - 1 : i);
}
// integer // and % as torch: through double while both operands are below 2^53 (exact, and
// int64 division would not vectorise); beyond, big is set and the row runs again with E =
// true: plain integer division (INT64_MIN / -1 wraps; torch's own process dies there)
static inline bool ak_small(int64_t a) {
  return a > -(INT64_C(1) << 53) && a < (INT64_C(1) << 53);
}
template <bool E> static inline int64_t ak_truncdiv(int64_t a, int64_t b, int& bad, int& big) {
  bad |= b == 0;
  b = b == 0 ? 1 : b;
  if (E) return b == -1 ? (int64_t)(UINT64_C(0) - (uint64_t)a) : a / b;
  const bool ok = ak_small(a) & ak_small(b);
  big |= !ok;
  return (int64_t)(ok ? (double)a / (double)b : 0.0);    // truncated (not lfloor: scalar)
}
template <bool E> static inline int64_t ak_floordiv(int64_t a, int64_t b, int& bad, int& big) {
  const int64_t q = ak_truncdiv<E>(a, b, bad, big);
  b = b == 0 ? 1 : b;
  return q - ((q * b != a) & ((a < 0) != (b < 0)));
}
template <bool E> static inline int64_t ak_mod(int64_t a, int64_t b, int& bad, int& big) {
  const int64_t q = ak_floordiv<E>(a, b, bad, big);
  return b == 0 ? 0 : a - q * b;
}
template <bool E> static inline int64_t ak_fmod_i(int64_t a, int64_t b, int& bad, int& big) {
  const int64_t q = ak_truncdiv<E>(a, b, bad, big);
  return b == 0 ? 0 : a - q * b;
}
// the same for an int64 node the narrow variant holds in int32 (|a| < 2^31: exact through
// double, and the result fits int32)
static inline int32_t ak_truncdiv32(int32_t a, int32_t b, int& bad) {
  bad |= b == 0;
  b = b == 0 ? 1 : b;
  return (int32_t)((double)a / (double)b);
}
static inline int32_t ak_floordiv32(int32_t a, int32_t b, int& bad) {
  const int32_t q = ak_truncdiv32(a, b, bad);
  b = b == 0 ? 1 : b;
  return q - ((q * b != a) & ((a < 0) != (b < 0)));
}
static inline int32_t ak_mod32(int32_t a, int32_t b, int& bad) {
  const int32_t q = ak_floordiv32(a, b, bad);
  return b == 0 ? 0 : a - q * b;
}
static inline int32_t ak_fmod_i32(int32_t a, int32_t b, int& bad) {
  const int32_t q = ak_truncdiv32(a, b, bad);
  return b == 0 ? 0 : a - q * b;
}
// a ** e as torch: wrapping; e < 0 gives 0 but for a = 1 (1) and a = -1 (±1)
static inline int64_t ak_ipow(int64_t a, int64_t e) {
  if (e < 0) return a == 1 ? 1 : (a == -1 ? ((e & 1) ? -1 : 1) : 0);
  uint64_t r = 1, x = (uint64_t)a;
  for (; e > 0; e >>= 1, x *= x) if (e & 1) r *= x;
  return (int64_t)r;
}
"""


def _rows(gen: Gen, out: _Val, fn: str) -> str:
    """The loop over one row, ``template <bool E> int fn(...)``: b, h, q, k0, kv and the
    key counter j as int64, or as int32 for the narrow variant (``gen.limit``). With
    distance tables (``gen.tables``) it is the loop over one chunk of a row's keys, reading
    table k from ``ak_t{k}`` (its entry for the chunk's key j at j), and ``fn`` the driver
    that finds those for each chunk (:func:`_tables`)."""
    caps = "".join(f"  const {t}* __restrict c{i} = static_cast<const {t}*>(caps[{i}]);\n"
                   for i, t in enumerate(gen.cap_types))
    tabs = "".join(f", const {v.ctype}* __restrict ak_t{k}" for k, v in enumerate(gen.table_vals))
    if tabs:
        driver, fn = _tables(gen, fn), fn + "_keys"
    S = gen.score_ct                                           # the row's C type
    P = "int64_t" if gen.limit is None else "int32_t"          # the positions' C type

    def body(grad: bool) -> str:
        lines = [s for is_t, s in gen.lines if grad or not is_t]
        tail = [f"x[j] = ({S})({out.code});"]
        if grad:
            tail.append(f"dx[j] = {f'({S})(' + out.tan + ')' if out.tan else f'({S})0'};")
        return "".join(f"      {s}\n" for s in lines + tail)

    head = f"    const {P} kv = k0 + j;\n    const {S} s = x[j] * sc;\n"   # (scaled here)
    simd = "#pragma omp simd reduction(|:bad, big)\n"          # with -fopenmp-simd
    loop = f"    for ({P} j = 0; j < ({P})n; ++j) {{\n"            # (narrow: n <= the limit)
    return ("template <bool E>\n"
            f"static inline int {fn}({S}* __restrict x, {S}* __restrict dx, int64_t n,\n"
            f"                       {P} b, {P} h, {P} q, {P} k0,\n"
            f"                       const void* const* caps, {S} sc, int& big_out{tabs}) {{\n"
            f"{caps}  int bad = 0, big = 0;\n  (void)b; (void)h; (void)q;\n"
            f"  if (dx) {{\n    const {S} ts = ({S})1; (void)ts;\n"
            f"{simd}{loop}{head}{body(True)}    }}\n"
            "  } else {\n"
            f"{simd}{loop}{head}{body(False)}    }}\n"
            "  }\n  big_out = big;\n  return bad;\n}\n\n" + (driver if tabs else ""))


def _tables(gen: Gen, fn: str) -> str:
    """The narrow variant's distance tables (:func:`distance_tables`) in C: one per-thread
    set over distances t = kv − q (entry t at t − base; [lo, hi) computed), filled where a
    chunk of a row asks for distances outside it, started afresh where they would not fit
    or (b, h) changed (when they depend on those); and ``fn``, the driver running
    ``fn + "_keys"`` over a row chunk by chunk with the chunk's table entries."""
    assert gen.tables is not None and gen.limit is not None
    S = gen.score_ct
    fields = "".join(f" {v.ctype} v{k}[AK_CAP];" for k, v in enumerate(gen.table_vals))
    lines = "".join(f"    {line}\n" for _, line in gen.table_lines)
    stores = "".join(f"    T.v{k}[t - T.base] = ({v.ctype})({v.code});\n"
                     for k, v in enumerate(gen.table_vals))
    kb, kh = gen.tables.keyed
    same = "T.hi > T.lo && T.mode == mode" + (" && T.b == b" if kb else "") + (
        " && T.h == h" if kh else "")
    ptrs = "".join(f", T.v{k} + (t0 - T.base)" for k in range(len(gen.table_vals)))
    return (
        "#define AK_CAP 16384    // distances per table (per thread)\n"
        "#define AK_CHUNK 4096   // keys of a row per table lookup (<= AK_CAP)\n"
        f"struct ak_tab {{ int32_t b, h, base, lo, hi; uint32_t mode;{fields} }};\n"
        "static thread_local ak_tab ak_T;   // (zeroed: nothing computed yet)\n"
        "// the float environment the values depend on: MXCSR's FTZ, DAZ and rounding bits\n"
        "static inline uint32_t ak_fp_mode() {\n"
        "#if defined(__x86_64__) || defined(__i386__)\n"
        "  return __builtin_ia32_stmxcsr() & 0xE040u;\n#else\n  return 0;\n#endif\n}\n"
        "// entries t0 <= t < t1, computed\n"
        "static void ak_fill(ak_tab& T, int32_t b, int32_t h, int32_t t0, int32_t t1) {\n"
        "  (void)b; (void)h;\n#pragma omp simd\n"
        f"  for (int32_t t = t0; t < t1; ++t) {{\n{lines}{stores}  }}\n}}\n"
        "// ak_table's fill, out of line (rare): T extended to [t0, t1), or afresh (same: T\n"
        "// holds the call's mode, and b, h where they count)\n"
        "__attribute__((noinline, cold)) static void ak_refill(ak_tab& T, bool same,\n"
        "    uint32_t mode, int32_t b, int32_t h, int32_t t0, int32_t t1) {\n"
        "  const int32_t lo = t0 < T.lo ? t0 : T.lo, hi = t1 > T.hi ? t1 : T.hi;\n"
        "  if (same && lo >= T.base && hi <= T.base + AK_CAP) {   // extend [lo, hi)\n"
        "    if (t0 < T.lo) ak_fill(T, b, h, t0, T.lo);\n"
        "    if (t1 > T.hi) ak_fill(T, b, h, T.hi, t1);\n"
        "    T.lo = lo;\n    T.hi = hi;\n    return;\n  }\n"
        "  T.b = b;\n  T.h = h;\n  T.mode = mode;\n"
        "  T.base = t0 - (AK_CAP - (t1 - t0)) / 2;   // afresh, centred\n"
        "  T.lo = t0;\n  T.hi = t1;\n  ak_fill(T, b, h, t0, t1);\n}\n"
        "// the tables with distances [t0, t1) computed (t1 - t0 <= AK_CHUNK); the check inline,\n"
        "// the fill not (inlined, its loops cost every row's call a spilling prologue)\n"
        "static inline const ak_tab& ak_table(int32_t b, int32_t h, int32_t t0, int32_t t1) {\n"
        "  ak_tab& T = ak_T;\n"
        "  const uint32_t mode = ak_fp_mode();   // (another FTZ/DAZ/rounding mode: afresh)\n"
        f"  const bool same = {same};\n"
        "  if (__builtin_expect(!(same && t0 >= T.lo && t1 <= T.hi), 0))\n"
        "    ak_refill(T, same, mode, b, h, t0, t1);\n"
        "  return T;\n}\n"
        "template <bool E>\n"
        f"static inline int {fn}({S}* __restrict x, {S}* __restrict dx, int64_t n,\n"
        "                       int32_t b, int32_t h, int32_t q, int32_t k0,\n"
        f"                       const void* const* caps, {S} sc, int& big_out) {{\n"
        "  int bad = 0, big = 0;\n"
        "  for (int64_t c = 0; c < n; c += AK_CHUNK) {          // keys [c, c + m) of the row\n"
        "    const int32_t m = (int32_t)(n - c < AK_CHUNK ? n - c : AK_CHUNK);\n"
        "    const int32_t t0 = k0 + (int32_t)c - q;            // the chunk's first distance\n"
        "    const ak_tab& T = ak_table(b, h, t0, t0 + m);\n"
        "    int got = 0;\n"
        f"    bad |= {fn}_keys<E>(x + c, dx ? dx + c : nullptr, m, b, h, q, k0 + (int32_t)c, "
        f"caps, sc, got{ptrs});\n"
        "    big |= got;\n  }\n  big_out = big;\n  return bad;\n}\n\n")


def _run(gen: Gen, fn: str) -> str:
    """The statements of ``attnkit_mod`` that run ``fn`` over the row (into ``bad``); with
    ``gen.exact`` (an int64 ``//`` or ``%``) a chunk of 256 keys whose operands reached 2^53
    (``big``) is restored and run again with ``E = true`` (exact integer division, scalar)."""
    S = gen.score_ct
    pos = "" if gen.limit is None else "(int32_t)"

    def call(e: str, k0: str, x: str, dx: str, m: str) -> str:
        return (f"{fn}<{e}>({x}, {dx}, {m}, {pos}b, {pos}h, {pos}q, {pos}({k0}), caps, "
                f"({S})scale, big)")

    if not gen.exact:
        return f"    int big = 0;\n    bad = {call('false', 'k0', 'x', 'dx', 'n')};\n"
    chunk = ("x + c", "dx ? dx + c : nullptr", "m")
    return (f"    for (int64_t c = 0; c < n; c += 256) {{\n"
            "      const int64_t m = n - c < 256 ? n - c : 256;\n"
            f"      {S} x0[256];\n"
            f"      __builtin_memcpy(x0, x + c, sizeof({S}) * m);\n"
            "      int big = 0;\n"
            f"      int got = {call('false', 'k0 + c', *chunk)};\n"
            "      if (big) {                   // an int64 operand >= 2^53: exactly\n"
            f"        __builtin_memcpy(x + c, x0, sizeof({S}) * m);\n"
            f"        got = {call('true', 'k0 + c', *chunk)};\n"
            "      }\n      bad |= got;\n    }\n")


def source(gen: Gen, out: _Val, narrow: tuple[Gen, _Val] | None = None, *,
           wide: bool = True) -> str:
    """The C++ file of ``attnkit_mod`` for the graph ``gen`` has run, returning ``out``.

    ``narrow``: the same graph run by ``Gen(limit=L)`` (and its output): rows whose b, h,
    q and keys are all below L run that variant (``ak_rows_n``, int32 positions: the loop
    vectorises on AVX2), the others the wide one (``ak_rows``, exact for every int64).
    ``wide=False`` (with ``narrow``): the narrow variant alone, for calls whose positions
    all stay below L (a third less to compile); a row beyond L is left as it is and sets
    bit 2 of the call's error flag (``ScoreModCall.check`` raises: such a call must bind the
    full build, see ``CompiledScoreMod.bind``)."""
    S = gen.score_ct
    flag = f"static_cast<int*>(const_cast<void*>(caps[{len(gen.caps)}]))"
    if narrow is None and not wide:
        raise ValueError("wide=False needs the narrow variant")
    rows = _rows(gen, out, "ak_rows") if wide else ""
    run = _run(gen, "ak_rows") if wide else ""
    if narrow is not None:
        ng, nout = narrow
        assert ng.limit is not None and len(ng.caps) == len(gen.caps)
        L = f"INT64_C({ng.limit})"
        rows += _rows(ng, nout, "ak_rows_n")
        beyond = run if wide else (f"    __atomic_fetch_or({flag}, 2, __ATOMIC_RELAXED);"
                                   "  // not built: positions past the limit\n")
        run = (f"  if (b >= 0 && h >= 0 && q >= 0 && k0 >= 0 && b < {L} && h < {L} && q < {L}"
               f" && n <= {L} - k0) {{\n"
               f"{_run(ng, 'ak_rows_n')}  }} else {{\n{beyond}  }}\n")
    else:
        run = "  {\n" + run + "  }\n"
    return (_PRELUDE + rows +
            f'extern "C" void attnkit_mod({S}* __restrict x, {S}* __restrict dx, int64_t n,\n'
            "                            int64_t b, int64_t h, int64_t q, int64_t k0,\n"
            "                            const void* const* caps, double scale) {\n"
            f"  int bad = 0;\n{run}"
            f"  if (bad) __atomic_fetch_or({flag}, 1, __ATOMIC_RELAXED);\n}}\n")


def uses_positions(gm: fx.GraphModule) -> bool:
    """Whether the score_mod reads b, h, q_idx or kv_idx (else one variant is enough)."""
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return any(n.users for n in ph[1:])
