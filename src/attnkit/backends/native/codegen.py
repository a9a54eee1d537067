"""C++ source for a traced score_mod (``score_mod.py`` traces, builds and loads it).

:class:`Gen` walks the ``torch.fx`` graph of ``score_mod(score, b, h, q_idx, kv_idx)``
(0-d arguments: per-score semantics) with each node's example value (its dtype), and emits
one C++ statement per node: the value, and — for floating nodes that depend on the score —
its derivative by the score (forward mode, torch's conventions). :func:`source` wraps the
statements in the loop ``attnkit_mod`` runs over one row of keys (see ``score_mod.py``).

Shape legend::

    s, ts           the score (S: float, or double for float64 inputs) and its derivative by
                    itself (1)
    b, h, q, kv     int64 indices; kv = k0 + j for key j of the row
    vN, tN          node N's value and derivative        cN  captured tensor N (flat, C order)

Caution
-------
- Float nodes compute in their dtype's C type (float16 / bfloat16 as float); integer nodes
  as int64; bool as bool. Any op outside ``_UNARY`` / ``_BINARY`` / the casts raises
  :class:`Unsupported`.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

__all__ = ["Gen", "Unsupported", "source"]


class Unsupported(Exception):
    """The score_mod cannot be compiled; the message says why."""


# ---------------------------------------------------------------- the graph's values
@dataclass
class _Val:
    """One value per score: a C expression (a variable or a literal) of ``ctype``; ``tan`` the
    variable holding its derivative by the score (None = 0)."""

    code: str
    ctype: str
    dtype: torch.dtype | None = None
    tan: str | None = None


@dataclass
class _Part:
    """A captured tensor, some leading free dims indexed: ``idx[d]`` None = still free."""

    cap: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    idx: list[_Val | None]


@dataclass
class _Const:
    value: Any


_FLOAT = {torch.float32: "float", torch.float16: "float", torch.bfloat16: "float",
          torch.float64: "double"}


def _ctype(dtype: torch.dtype) -> str:
    if dtype in _FLOAT:
        return _FLOAT[dtype]
    if dtype == torch.bool:
        return "bool"
    if not dtype.is_floating_point and not dtype.is_complex:
        return "int64_t"
    raise Unsupported(f"dtype {dtype} has no C type here")


def _is_float(ct: str) -> bool:
    return ct in ("float", "double")


def _literal(x: Any) -> _Val:
    if isinstance(x, bool):
        return _Val("true" if x else "false", "bool", torch.bool)
    if isinstance(x, int):
        return _Val(f"INT64_C({x})", "int64_t", torch.int64)
    if isinstance(x, float):
        if math.isnan(x):
            code = "(double)NAN"
        elif math.isinf(x):
            code = "(double)INFINITY" if x > 0 else "(-(double)INFINITY)"
        else:
            code = repr(x)
            code = code if ("e" in code or "." in code) else code + ".0"
        return _Val(code, "double", torch.float64)
    raise Unsupported(f"argument {x!r} ({type(x).__name__}) is not a number")


def _cast(v: _Val, ct: str) -> str:
    if v.ctype == ct:
        return v.code
    if ct == "bool":
        return f"({v.code} != 0)"
    return f"(({ct})({v.code}))"


def _tan(v: _Val, ct: str) -> str | None:
    return None if v.tan is None else _cast(_Val(v.tan, v.ctype), ct)


def _sum(*terms: str | None) -> str | None:
    got = [t for t in terms if t is not None]
    return None if not got else "(" + " + ".join(got) + ")"


# name -> (value template, derivative template or None = 0); a = operand, y = the result,
# ta = the operand's derivative, T = the C type
_UNARY: dict[str, tuple[str, str | None]] = {
    "neg": ("(-{a})", "(-{ta})"), "pos": ("{a}", "{ta}"),
    "abs": ("ak_abs({a})", "(ak_sgn({a}) * {ta})"),
    "exp": ("ak_exp({a})", "({ta} * {y})"),
    "exp2": ("std::exp2({a})", "({ta} * {y} * (T)0.6931471805599453)"),
    "expm1": ("std::expm1({a})", "({ta} * ({y} + (T)1))"),
    "log": ("ak_log({a})", "({ta} / {a})"),
    "log2": ("std::log2({a})", "({ta} / ({a} * (T)0.6931471805599453))"),
    "log10": ("std::log10({a})", "({ta} / ({a} * (T)2.302585092994046))"),
    "log1p": ("std::log1p({a})", "({ta} / ((T)1 + {a}))"),
    "sqrt": ("std::sqrt({a})", "({ta} / ((T)2 * {y}))"),
    "rsqrt": ("((T)1 / std::sqrt({a}))", "((T)-0.5 * {ta} * {y} * {y} * {y})"),
    "tanh": ("ak_tanh({a})", "({ta} * ((T)1 - {y} * {y}))"),
    "sigmoid": ("ak_sigmoid({a})", "({ta} * {y} * ((T)1 - {y}))"),
    "sin": ("std::sin({a})", "({ta} * std::cos({a}))"),
    "cos": ("std::cos({a})", "(-{ta} * std::sin({a}))"),
    "erf": ("std::erf({a})", "({ta} * (T)1.1283791670955126 * std::exp(-{a} * {a}))"),
    "reciprocal": ("((T)1 / {a})", "(-{ta} * {y} * {y})"),
    "relu": ("(({a} > (T)0 || {a} != {a}) ? {a} : (T)0)", "({y} > (T)0 ? {ta} : (T)0)"),
    "square": ("({a} * {a})", "((T)2 * {a} * {ta})"),
    "sign": ("ak_sgn({a})", None), "floor": ("std::floor({a})", None),
    "ceil": ("std::ceil({a})", None), "trunc": ("std::trunc({a})", None),
    "round": ("std::nearbyint({a})", None), "frac": ("({a} - std::trunc({a}))", "{ta}"),
}
_INT_UNARY = {"neg", "pos", "abs", "sign", "square", "floor", "ceil", "trunc", "round", "relu"}
_ARITH = {"add", "sub", "rsub", "mul", "div", "floor_divide", "remainder", "fmod", "pow",
          "minimum", "maximum", "fmin", "fmax"}
_COMPARE = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
_LOGIC = {"logical_and": "&&", "logical_or": "||", "logical_xor": "!=", "and": "&",
          "or": "|", "xor": "^", "bitwise_and": "&", "bitwise_or": "|", "bitwise_xor": "^"}
_BINARY = _ARITH | set(_COMPARE) | set(_LOGIC)
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
            "__invert__": "invert", "eq": "eq", "clamp_min": "clamp_min"}
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


# ---------------------------------------------------------------- code generation
class Gen:
    """``score_dtype``: float32 (the kernel's float rows, for float32 / bfloat16 / float16
    inputs) or float64 (its double rows)."""

    def __init__(self, gm: fx.GraphModule, examples: dict[fx.Node, Any], grad: bool,
                 score_dtype: torch.dtype = torch.float32) -> None:
        self.gm, self.ex, self.grad = gm, examples, grad
        self.score_dtype = score_dtype
        self.score_ct = _ctype(score_dtype)
        self.lines: list[tuple[bool, str]] = []      # (is a derivative line, C statement)
        self.caps: list[torch.Tensor] = []
        self.cap_types: list[str] = []
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

    def capture(self, t: torch.Tensor) -> _Part | _Val:
        if not isinstance(t, torch.Tensor) or t.is_complex() or t.device.type != "cpu":
            raise Unsupported(f"captured {type(t).__name__} {getattr(t, 'dtype', '')} "
                              f"{getattr(t, 'device', '')} (a CPU real tensor is needed)")
        if self.grad and t.requires_grad:
            raise Unsupported(f"captured tensor of shape {tuple(t.shape)} requires grad (the "
                              "native kernel differentiates the score only)")
        store = torch.float64 if t.dtype == torch.float64 else (
            torch.float32 if t.dtype.is_floating_point else torch.int64)
        self.caps.append(t.detach().to(store).contiguous())
        self.cap_types.append(_ctype(store))
        part = _Part(len(self.caps) - 1, tuple(t.shape), t.dtype, [None] * t.dim())
        return self.load(part) if t.dim() == 0 else part

    def load(self, p: _Part) -> _Val:
        off, stride = [], 1
        for d in range(len(p.shape) - 1, -1, -1):
            i = self.new("int64_t", f"ak_idx({_cast(p.idx[d], 'int64_t')}, "  # type: ignore[arg-type]
                                    f"INT64_C({p.shape[d]}), bad)")
            off.append(f"{i} * INT64_C({stride})")
            stride *= p.shape[d]
        addr = " + ".join(off) if off else "0"
        if stride < 2**31:          # clamped indices: the offset fits int32 (faster gathers)
            addr = f"(int32_t)({addr})"
        raw = _Val(f"c{p.cap}[{addr}]", self.cap_types[p.cap])
        ct = _ctype(p.dtype)
        return _Val(self.new(ct, _cast(raw, ct)), ct, p.dtype)

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
            if isinstance(it, (int, bool)) and not isinstance(it, bool):
                it = _literal(it)
            if not isinstance(it, _Val) or it.ctype != "int64_t":
                raise Unsupported(f"index {it!r} into a captured tensor (integer expressions "
                                  "of b, h, q_idx, kv_idx only)")
            idx[d] = it
        q = _Part(p.cap, p.shape, p.dtype, idx)
        return self.load(q) if all(x is not None for x in idx) else q

    def run(self) -> _Val:
        env: dict[fx.Node, Any] = {}
        holders = iter([_Val("s", self.score_ct, self.score_dtype, "ts")] +
                       [_Val(n, "int64_t", torch.int64) for n in ("b", "h", "q", "kv")])
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(holders)
            elif node.op == "get_attr":
                env[node] = self.capture(getattr(self.gm, str(node.target)))
            elif node.op in ("call_function", "call_method"):
                args = fx.node.map_arg(node.args, lambda n: env[n])
                kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
                env[node] = self.call(_op_name(node), args, kwargs, self.ex.get(node))
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
                return self.index(args[0], args[1])
            raise Unsupported("indexing a per-score value (it is a single number)")
        if isinstance(args[0], _Part) and name in _CASTS | {"detach", "contiguous", "clone"}:
            p = args[0]
            return _Part(p.cap, p.shape, ex.dtype if isinstance(ex, torch.Tensor) else p.dtype,
                         p.idx)
        if not isinstance(ex, torch.Tensor) or ex.numel() != 1:
            raise Unsupported(f"{name} does not give one value per score "
                              f"(example: {type(ex).__name__} {getattr(ex, 'shape', '')})")
        dtype = ex.dtype
        ct = _ctype(dtype)
        if name in _CASTS or name in _SAME:
            a = self.operand(args[0])
            return self.value(ct, dtype, _cast(a, ct), _tan(a, ct))
        if name == "detach":
            a = self.operand(args[0])
            return self.value(ct, dtype, _cast(a, ct), None)
        if name in ("full_like", "zeros_like", "ones_like"):
            fill = {"zeros_like": 0, "ones_like": 1}.get(name)
            f = self.operand(args[1] if fill is None else fill)
            return self.value(ct, dtype, _cast(f, ct), None)
        if name in _UNARY or name in ("invert", "not"):
            return self.unary(name, self.operand(args[0]), ct, dtype, kwargs)
        if name in ("clamp", "clamp_min", "clamp_max"):
            return self.clamp(name, args, kwargs, ct, dtype)
        if name == "where":
            c, a, b = (self.operand(x) for x in args[:3])
            cc = _cast(c, "bool")
            t = None
            if a.tan or b.tan:
                t = f"({cc} ? {_tan(a, ct) or '(' + ct + ')0'} : {_tan(b, ct) or '(' + ct + ')0'})"
            return self.value(ct, dtype, f"({cc} ? {_cast(a, ct)} : {_cast(b, ct)})", t)
        if name == "masked_fill":
            a, m, f = (self.operand(x) for x in args[:3])
            mc = _cast(m, "bool")
            t = None if a.tan is None else f"({mc} ? ({ct})0 : {_tan(a, ct)})"
            return self.value(ct, dtype, f"({mc} ? {_cast(f, ct)} : {_cast(a, ct)})", t)
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
            return self.value(ct, dtype, f"(~{_cast(a, ct)})", None)
        if not _is_float(ct) and name not in _INT_UNARY:
            raise Unsupported(f"{name} on integers")
        val_t, tan_t = _UNARY[name]
        if not _is_float(ct) and name in ("floor", "ceil", "trunc", "round"):
            val_t = "{a}"
        ac = _cast(a, ct)
        y = self.new(ct, val_t.format(a=ac).replace("(T)", f"({ct})"))
        t = None
        if tan_t is not None and a.tan is not None and _is_float(ct):
            t = self.new(ct, tan_t.format(a=ac, y=y, ta=_tan(a, ct)).replace("(T)", f"({ct})"),
                         tangent=True)
        return _Val(y, ct, dtype, t)

    def clamp(self, name: str, args: tuple, kwargs: dict, ct: str, dtype: torch.dtype) -> _Val:
        a = self.operand(args[0])
        lo = kwargs.get("min", args[1] if len(args) > 1 and name != "clamp_max" else None)
        hi = kwargs.get("max", args[2] if len(args) > 2 else (
            args[1] if name == "clamp_max" and len(args) > 1 else None))
        code, conds, tan = _cast(a, ct), [], _tan(a, ct)
        lo_v = None if lo is None else self.operand(lo)
        hi_v = None if hi is None else self.operand(hi)
        if lo_v is not None:
            code = f"ak_max_c({code}, {_cast(lo_v, ct)})"
            conds.append(f"{_cast(a, ct)} >= {_cast(lo_v, ct)}")
        if hi_v is not None:
            code = f"ak_min_c({code}, {_cast(hi_v, ct)})"
            conds.append(f"{_cast(a, ct)} <= {_cast(hi_v, ct)}")
        t = None
        if _is_float(ct):
            parts = []
            if tan is not None:
                parts.append(f"(({' && '.join(conds) or 'true'}) ? {tan} : ({ct})0)")
            if lo_v is not None and lo_v.tan is not None:
                parts.append(f"({_cast(a, ct)} < {_cast(lo_v, ct)} ? {_tan(lo_v, ct)} : ({ct})0)")
            if hi_v is not None and hi_v.tan is not None:
                parts.append(f"({_cast(a, ct)} > {_cast(hi_v, ct)} ? {_tan(hi_v, ct)} : ({ct})0)")
            t = _sum(*parts)
        return self.value(ct, dtype, code, t)

    def binary(self, name: str, a: _Val, b: _Val, ct: str, dtype: torch.dtype,  # noqa: C901
               raw: tuple) -> _Val:
        if name in _COMPARE or name in ("logical_and", "logical_or", "logical_xor"):
            if name in _COMPARE:
                ex = [self.ex.get(x) if isinstance(x, fx.Node) else x for x in raw[:2]]
                cmp = _ctype(torch.result_type(*[_example(e, v) for e, v in zip(ex, (a, b),
                                                                                  strict=True)]))
                op = _COMPARE[name]
            else:
                cmp, op = "bool", _LOGIC[name]
            return self.value("bool", torch.bool, f"({_cast(a, cmp)} {op} {_cast(b, cmp)})", None)
        if name in _LOGIC:
            if _is_float(ct):
                raise Unsupported(f"{name} on floats")
            op = {"and": "&&", "or": "||", "xor": "!="}.get(name) if ct == "bool" else None
            return self.value(ct, dtype, f"({_cast(a, ct)} {op or _LOGIC[name]} {_cast(b, ct)})",
                              None)
        A, B = _cast(a, ct), _cast(b, ct)
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
        if name == "div":
            y = self.new(ct, f"({A} / {B})")
            t = None
            if ta is not None or tb is not None:
                za, zb = ta or f"({ct})0", tb or f"({ct})0"
                t = self.new(ct, f"(({za} - {y} * {zb}) / {B})", tangent=True)
            return _Val(y, ct, dtype, t)
        if name in ("floor_divide", "trunc_divide"):
            if fl:                                       # torch's rounding (from fmod)
                f = "ak_ffloordiv" if name == "floor_divide" else "ak_ftruncdiv"
                return self.value(ct, dtype, f"{f}({A}, {B})", None)
            f = "ak_floordiv" if name == "floor_divide" else "ak_truncdiv"
            return self.value(ct, dtype, f"{f}({A}, {B}, bad)", None)
        if name in ("remainder", "fmod"):
            if not fl:
                f = "ak_mod" if name == "remainder" else "ak_fmod_i"
                return self.value(ct, dtype, f"{f}({A}, {B}, bad)", None)
            if name == "remainder":                      # torch: fmod, moved to b's sign
                return self.value(ct, dtype, f"ak_fremainder({A}, {B})", _sum(
                    ta, None if tb is None else f"(-{tb} * ak_ffloordiv({A}, {B}))"))
            return self.value(ct, dtype, f"std::fmod({A}, {B})",
                              _sum(ta, None if tb is None else f"(-{tb} * ak_ftruncdiv({A}, {B}))"))
        if name == "pow":
            if not fl:
                return self.value(ct, dtype, f"ak_ipow({A}, {B})", None)
            e = _number(raw[1])
            if e is not None and (e == 0.5 or (e == int(e) and 1 <= abs(e) <= 4)):
                # a^e as products (or a square root): loops with it vectorise
                pos = f"std::sqrt({A})" if e == 0.5 else "(" + " * ".join([A] * int(abs(e))) + ")"
                y = self.new(ct, pos if e > 0 else f"(({ct})1 / {pos})")
                d = (f"(({ct})0.5 / {y})" if e == 0.5 else
                     f"(({ct}){e} * {y} / {A})" if e < 0 else
                     f"(({ct}){int(e)}" + "".join(f" * {A}" for _ in range(int(e) - 1)) + ")")
                t = None if ta is None else self.new(ct, f"({ta} * {d})", tangent=True)
                return _Val(y, ct, dtype, t)
            y = self.new(ct, f"std::pow({A}, {B})")
            parts = []
            if ta is not None:
                parts.append(f"({B} == ({ct})0 ? ({ct})0 : "
                             f"{ta} * {B} * std::pow({A}, {B} - ({ct})1))")
            if tb is not None:
                parts.append(f"(({A} == ({ct})0 && {B} >= ({ct})0) ? ({ct})0 : "
                             f"{tb} * {y} * std::log({A}))")
            t = _sum(*parts)
            return _Val(y, ct, dtype, None if t is None else self.new(ct, t, tangent=True))
        if name in ("minimum", "maximum", "fmin", "fmax"):
            f = {"minimum": "ak_min", "maximum": "ak_max", "fmin": "std::fmin",
                 "fmax": "std::fmax"}[name]
            t = None
            if ta is not None or tb is not None:
                za, zb = ta or f"({ct})0", tb or f"({ct})0"
                if name in ("minimum", "maximum"):
                    gt = ">" if name == "maximum" else "<"
                    t = (f"({A} == {B} ? ({za} + {zb}) * ({ct})0.5 : "
                         f"({A} {gt} {B} ? {za} : {zb}))")
                else:
                    ge = ">=" if name == "fmax" else "<="
                    t = f"(({A} {ge} {B} || {B} != {B}) ? {za} : {zb})"
            return self.value(ct, dtype, f"{f}({A}, {B})", t)
        raise Unsupported(f"op {name!r}")


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
#include <cmath>
#include <cstdint>
template <class T> static inline T ak_abs(T a) { return a < (T)0 ? -a : a; }
template <class T> static inline T ak_sgn(T a) { return (T)((a > (T)0) - (a < (T)0)); }
template <class T> static inline T ak_max(T a, T b) {
  return a != a ? a : (b != b ? b : (a > b ? a : b));
}
template <class T> static inline T ak_min(T a, T b) {
  return a != a ? a : (b != b ? b : (a < b ? a : b));
}
template <class T> static inline T ak_max_c(T a, T lo) { return a < lo ? lo : a; }
template <class T> static inline T ak_min_c(T a, T hi) { return a > hi ? hi : a; }
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
static inline double ak_exp(double x) { return std::exp(x); }
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
static inline double ak_tanh(double x) { return std::tanh(x); }
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
static inline double ak_log(double x) { return std::log(x); }
// 1 / (1 + e^-x) through e = e^-|x| (both tails keep their relative accuracy)
template <class T> static inline T ak_sigmoid(T x) {
  const T e = ak_exp(x < (T)0 ? x : -x);
  return (x < (T)0 ? e : (T)1) / ((T)1 + e);
}
// float % and // as torch computes them: from the exact fmod (a - b * floor(a / b) loses
// the remainder once a / b rounds), the remainder moved to b's sign, the quotient rounded
template <class T> static inline T ak_fremainder(T a, T b) {
  const T m = std::fmod(a, b);
  return (m != (T)0 && ((b < (T)0) != (m < (T)0))) ? m + b : m;
}
template <class T> static inline T ak_ffloordiv(T a, T b) {
  if (b == (T)0) return a / b;
  const T m = std::fmod(a, b);
  T d = (a - m) / b;
  if (m != (T)0 && ((b < (T)0) != (m < (T)0))) d -= (T)1;
  if (d == (T)0) return std::copysign((T)0, a / b);
  const T f = std::floor(d);
  return d - f > (T)0.5 ? f + (T)1 : f;
}
template <class T> static inline T ak_ftruncdiv(T a, T b) { return std::trunc(a / b); }
static inline int64_t ak_idx(int64_t i, int64_t size, int& bad) {
  i = i < 0 ? i + size : i;
  bad |= (i < 0) | (i >= size);
  return i < 0 ? 0 : (i >= size ? size - 1 : i);
}
// integer // and % through double (exact for |a| < 2^53; int64 division would not vectorise)
static inline int64_t ak_floordiv(int64_t a, int64_t b, int& bad) {
  bad |= b == 0;
  b = b == 0 ? 1 : b;
  const int64_t q = (int64_t)((double)a / (double)b);       // truncated (not lfloor: scalar)
  return q - ((q * b != a) & ((a < 0) != (b < 0)));
}
static inline int64_t ak_truncdiv(int64_t a, int64_t b, int& bad) {
  bad |= b == 0;
  return (int64_t)((double)a / (double)(b == 0 ? 1 : b));
}
static inline int64_t ak_mod(int64_t a, int64_t b, int& bad) {
  const int64_t q = ak_floordiv(a, b, bad);
  return b == 0 ? 0 : a - q * b;
}
static inline int64_t ak_fmod_i(int64_t a, int64_t b, int& bad) {
  const int64_t q = ak_truncdiv(a, b, bad);
  return b == 0 ? 0 : a - q * b;
}
static inline int64_t ak_ipow(int64_t a, int64_t e) {
  int64_t r = 1;
  for (; e > 0; e >>= 1, a *= a) if (e & 1) r *= a;
  return r;
}
"""


def source(gen: Gen, out: _Val) -> str:
    """The C++ file of ``attnkit_mod`` for the graph ``gen`` has run, returning ``out``."""
    caps = "".join(f"  const {t}* __restrict c{i} = static_cast<const {t}*>(caps[{i}]);\n"
                   for i, t in enumerate(gen.cap_types))

    S = gen.score_ct                                           # the row's C type

    def body(grad: bool) -> str:
        lines = [s for is_t, s in gen.lines if grad or not is_t]
        tail = [f"x[j] = ({S})({out.code});"]
        if grad:
            tail.append(f"dx[j] = {f'({S})(' + out.tan + ')' if out.tan else f'({S})0'};")
        return "".join(f"      {s}\n" for s in lines + tail)

    head = f"    const int64_t kv = k0 + j;\n    const {S} s = x[j];\n"
    simd = "#pragma omp simd reduction(|:bad)\n"                # with -fopenmp-simd
    return (_PRELUDE +
            f'extern "C" void attnkit_mod({S}* __restrict x, {S}* __restrict dx, int64_t n,\n'
            "                            int64_t b, int64_t h, int64_t q, int64_t k0,\n"
            "                            const void* const* caps) {\n"
            f"{caps}  int bad = 0;\n  (void)b; (void)h; (void)q;\n"
            f"  if (dx) {{\n    const {S} ts = ({S})1; (void)ts;\n"
            f"{simd}    for (int64_t j = 0; j < n; ++j) {{\n{head}{body(True)}    }}\n"
            "  } else {\n"
            f"{simd}    for (int64_t j = 0; j < n; ++j) {{\n{head}{body(False)}    }}\n"
            "  }\n"
            "  if (bad) __atomic_store_n(static_cast<int*>(const_cast<void*>("
            f"caps[{len(gen.caps)}])), 1, __ATOMIC_RELAXED);\n}}\n")
