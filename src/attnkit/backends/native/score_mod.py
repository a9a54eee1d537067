"""A user's Python score_mod, compiled into a small C++ function the native kernel calls.

FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx)`` means what it returns for ONE score
and four scalar indices. Here it is traced once per call with ``torch.fx.symbolic_trace``
(each of the five arguments a 0-d Proxy, so the trace has exactly the per-score semantics,
chained indexing such as ``bias[b][h][q_idx][kv_idx]`` included), run once on 0-d example
values (which gives every node its dtype, with torch's type promotion), and written as a C++
loop over the keys of one row (``codegen.py``)::

    extern "C" void attnkit_mod(S* x, S* dx, int64_t n, int64_t b, int64_t h,
                                int64_t q, int64_t k0, const void* const* caps, double scale)
    // x[j] <- mod(x[j] * scale, b, h, q, k0 + j) for j < n (scale: the call's, where the
    // kernel passes raw scores; 1 for scores it scaled and soft-capped itself); with dx also
    // dx[j] <- d mod / d score
    // S = float for the kernel's float32 rows (float32 / bfloat16 / float16 inputs), double
    // for float64 inputs (traced with a float64 example score: its own build)

The derivative is forward-mode from the same graph (every node carries its value and its
derivative by the score, with torch's conventions: ``abs'(0) = 0``, a clamp passes the
gradient at its bounds, ``maximum`` / ``minimum`` split it on ties and pass it to both
operands at a NaN). The source is compiled
by the plain C++ compiler (no torch headers, not even ``<cmath>``: ~0.1–0.2 s) with ``-O3`` and the
CPU's vector flags (``loader.cpu_flags``) into ``loader.cache_dir() / "score_mod"``, keyed by
the hash of source, flags and compiler, loaded with ctypes, and kept in a bounded in-process
cache (``_CACHE_SIZE`` libraries). Captured tensors are not baked into the source: their
shapes and dtypes are, and their data is read at each call (:meth:`CompiledScoreMod.bind`:
in place, or widened to float32 / int32 for 8- and 16-bit dtypes; with the call's own error
flag, ``caps``) — a
new closure of the same code with new values reuses the build, and two threads calling one
compiled score_mod share nothing but its code.

Shape legend::

    score      0-d float32 or float64 (the scaled, soft-capped logit)
    b, h, q_idx, kv_idx  0-d int64
    x, dx      (n,) a row of one or two key tiles, n <= 256    caps  (C + 1,) data pointers
    captured   any shape, indexed by integer expressions of b, h, q_idx, kv_idx and constants

Supported: Python scalars; arithmetic, comparisons, logical / bitwise ops, ``where``,
``masked_fill``, ``clamp``, ``minimum`` / ``maximum``, dtype casts, ``floor`` / ``round`` /
``remainder`` / ``floor_divide`` and the common elementwise functions (``exp``, ``log``,
``sqrt``, ``rsqrt``, ``tanh``, ``sigmoid``, ``pow``, ``sin``, ``cos``, ``erf``, ...) — see
``codegen._UNARY`` and ``codegen._BINARY``; captured tensors read by integer indices (``slopes[h]``,
``table[h, q_idx - kv_idx + M]``, ``bias[b, h, q_idx, kv_idx]``, ``t.to(x.dtype)[h]``).

Caution
-------
- Anything else — another op, data-dependent Python control flow, ``.item()``, a captured
  tensor that requires grad while autograd records, a call that fails on the 0-d example —
  is *not supported*: :func:`for_problem` returns the reason and the call keeps its Python
  path (``tiled``'s compiled or general engine), whose reasons list says why.
- A failed build or no compiler: one ``RuntimeWarning`` per source (no compiler: per
  process), then the Python path, and the build is not retried in this process — except
  after a compiler killed by a signal (Ctrl-C, out of memory), which the next call retries.
  A cached library is loaded only once it matches its checksum (``loader.cached_library``).
- Out-of-range indices (torch raises ``IndexError``) and integer division by zero are
  clamped / zeroed in the kernel (no out-of-bounds read) and raise ``IndexError`` after the
  call — but only where the kernel evaluated the score_mod: keys of tiles a mask leaves
  empty are never visited (the reference evaluates every score).
- Each node computes what torch computes for it (``codegen``'s Caution has the rules;
  ``tests/backends/test_native_score_mod_ops.py`` checks every op and dtype against torch):
  integers in their own width, wrapping as torch's do (int8 / uint8 / int16 / int32 /
  int64; ``//`` and ``%`` exact for all int64, through double below 2^53), float16 /
  bfloat16 nodes rounded to their format after every op, ``a ** b`` of integers 0 for
  b < 0 (but a = ±1), float -> integer casts of NaN / inf / out-of-range values as torch on
  x86-64. Functions torch itself approximates (``exp``, ``tanh``, ``sin``, float32 ``sqrt``,
  general ``pow``, ...) agree to a few ulp of the node's dtype, not to the bit: a float64
  call whose score_mod computes them in float32 agrees with the reference to float32
  precision there. A captured 0-d tensor whose type promotion with a per-score value differs
  between the 0-d trace and torch's batched evaluation (``score * torch.tensor(2.0,
  dtype=torch.float64)`` with float32 scores) is not supported (the Python path runs it).
  Arithmetic, comparisons, ``where``, ``sqrt``, small integer powers, captured-tensor reads
  (int32 offsets: gathers) and float32 ``exp`` / ``log`` / ``tanh`` / ``sigmoid``
  (attnkit's own, <= 1.5 ulp) vectorise; ``sin``, ``erf``, ``log1p``, general ``pow`` ...
  are the C library's scalar calls, and a loop holding one runs scalar — except where the
  node reads the positions only through ``q_idx - kv_idx`` (with b, h, literals): such a
  costly node is computed once per distance into a per-thread table and read per score
  (``codegen.distance_tables``; the same values). Position arithmetic
  (``q_idx - kv_idx``, ``//``, ``%``, clamps, table offsets) runs in int32 while every
  position is below 2^24 (``codegen.POSITION_LIMIT``; int64 beyond, exact either way), so
  on AVX2 it vectorises too; a float -> int64 cast (``.long()`` of a float) does not. A
  call whose batch, heads, queries and keys are all at most 2^24 (:func:`for_problem`'s
  ``extent``, from the kernel's call) builds the int32 variant alone; the int64 one is
  built (with it, a second library) only when a larger call comes.
  Measured forward speed against the plain causal call (fp32, N=4096, 2 cores, load ~1):
  ALiBi-like functions 0.9–1.0×, hand-written tanh soft-cap 0.75×, T5 log-buckets 0.5×;
  ``score - 0.02 * (q_idx - kv_idx).abs().float().sqrt()`` (AMD Zen 3, AVX2, 1 thread, CPU
  time) 0.87× (0.67× with int64 positions), forward + backward 0.93× (0.85×).
- Each call runs the score_mod once eagerly on 0-d examples under a ``TorchFunctionMode``
  (~0.15 ms): its op signature — the ops, their Python arguments, and each captured tensor's
  identity, version counter, data pointer, shape and dtype — finds an earlier trace of the
  same code (``stats()["reused"]``); anything else (an in-place update, a rebound closure,
  a changed Python constant) is traced again (~3 ms; more on a loaded machine). The data a
  reused trace reads is always the current one: captured tensors are read at each call (a
  write torch does not see — ``t.data[...] = ``, through ``.numpy()`` — included), and what
  the trace folds into a constant (``table.long()``, ``torch.tensor(array)``,
  ``torch.as_tensor(array)``) is keyed by the contents of the tensors and NumPy arrays it
  came from (hashed per call, ~10–25 µs for 1k entries; beyond 1 MiB each, or with another
  kind of object argument or a random function, the call is traced afresh). The cache
  keeps the captured tensors alive (at most ``_CACHE_SIZE`` entries).
- Built with ``-ffp-contract=off``: no multiply-add is fused, so every elementwise op rounds
  as torch's op does; ``-fwrapv``: signed integers wrap, as torch's do. The build
  runs per new source (~0.1–0.2 s of one core on Zen 3, most of it optimising the loops;
  once per process, or never again once on disk). A new score_mod's first
  call in a fresh process: 0.3–0.6 s on a busy 2-core machine (the build, the trace, and
  the process's first full garbage collection, ~0.1 s, which lands in the trace).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import hashlib
import os
import subprocess
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.fx as fx

from ... import _compat
from ...scores import ScoreTerm, fn_name, unwrap
from . import loader
from .codegen import POSITION_LIMIT, Gen, Unsupported, distance_tables, source, uses_positions

__all__ = ["CompiledScoreMod", "ScoreModCall", "for_problem", "compile_score_mod", "stats",
           "clear", "Unsupported"]

_CACHE_SIZE = 64
_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp-simd",
          "-fwrapv", "-shared", "-fPIC"]   # no FMA contraction: each op rounds as torch rounds
# it; -fwrapv: signed integers wrap (two's complement), as torch's do
_CONTENT_LIMIT = 1 << 20        # bytes of captured data a signature may hash per call

@dataclass
class CompiledScoreMod:
    """A loaded score_mod: the C function's ``address``, the tensors it reads (``sources``: the
    trace's captured tensors themselves) and the dtype the kernel reads each as (``stores``).
    One object serves many calls and threads; a call's own state — the captured data as it is
    at that call, and its error flag — is the :class:`ScoreModCall` that :meth:`bind` returns.

    ``limit``: the loaded build serves calls whose batch, heads, queries and keys are all at
    most this many (the narrow variant alone, built for such a call: ``extent`` of
    :func:`compile_score_mod`); None: any call. :meth:`bind` of a larger call builds the full
    library first (:meth:`widen`)."""

    name: str
    address: int
    sources: list[torch.Tensor] = field(repr=False)
    stores: list[torch.dtype] = field(repr=False)
    dtype: torch.dtype = torch.float32                     # the row type it was built for
    limit: int | None = None
    full_source: str | None = field(default=None, repr=False)   # (while ``limit`` is set)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def serves(self, extent: int | None) -> bool:
        """Whether the loaded build runs a call of this ``extent`` (None: any call)."""
        return self.limit is None or (extent is not None and extent <= self.limit)

    def widen(self) -> None:
        """Build (or load) the full library — both variants, any position — and use it from
        now on; raises :class:`Unsupported` (after its one warning) when it cannot be built.
        Calls bound before keep the narrow build, which stays loaded."""
        with self._lock:
            if self.limit is None:
                return
            assert self.full_source is not None
            self.address = _build(self.name, self.full_source)
            self.limit, self.full_source = None, None

    def bind(self, extent: int | None = None) -> ScoreModCall:
        """One call's ``caps``: the captured tensors' data as it is now — float32 / float64 /
        int32 / int64 read in place, narrower dtypes widened (copied, as is a non-contiguous
        tensor) — and a fresh error flag. ``extent``: the call's largest of batch, heads,
        queries and keys (None: unknown), which the bound build must serve (:meth:`widen`)."""
        if not self.serves(extent):
            self.widen()
        tensors = [t.detach().to(s).contiguous()
                   for t, s in zip(self.sources, self.stores, strict=True)]
        flag = torch.zeros(1, dtype=torch.int32)
        ptrs = [t.data_ptr() for t in tensors] + [flag.data_ptr()]
        array = (ctypes.c_void_p * len(ptrs))(*ptrs)
        return ScoreModCall(self.name, self.address, ctypes.addressof(array), tensors, flag,
                            array, self.dtype)


@dataclass
class ScoreModCall:
    """One call of a :class:`CompiledScoreMod`: the C function's ``address`` and
    ``caps_address`` (a ``void*`` array of the captured data and this call's error flag),
    which keep their memory alive (also for the backward of the same call)."""

    name: str
    address: int
    caps_address: int
    tensors: list[torch.Tensor] = field(repr=False)
    flag: torch.Tensor = field(repr=False)
    _array: Any = field(repr=False, default=None)
    dtype: torch.dtype = torch.float32

    def check(self) -> None:
        """Raise ``IndexError`` when the kernel met an out-of-range index (or / 0) — flag bit
        1 — or ``RuntimeError`` when it ran a narrow-only build past its limit (bit 2: the
        call was bound without its extent; its result is wrong)."""
        got = int(self.flag[0])
        if got:
            self.flag.zero_()
            if got & 2:
                raise RuntimeError(
                    f"score_mod {self.name}: its narrow build (positions below "
                    f"{POSITION_LIMIT}) ran rows past that limit; bind it with the call's "
                    "extent (CompiledScoreMod.bind(extent)) so the full build is used")
            raise IndexError(
                f"score_mod {self.name} indexed a captured tensor out of range (or divided an "
                "integer by zero) for some (b, h, q_idx, kv_idx) of this call, where torch "
                "raises; keep indices within the captured tensors' shapes (clamp them)")


# ---------------------------------------------------------------- trace, build, cache
class _Examples(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[fx.Node, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        r = super().run_node(n)
        self.values[n] = r
        return r


_TRACE_LOCK = threading.Lock()


def _trace(fn: Any, score_dtype: torch.dtype) -> tuple[fx.GraphModule, dict[fx.Node, Any]]:
    def score_mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return fn(score, b, h, q_idx, kv_idx)

    try:
        with _TRACE_LOCK, warnings.catch_warnings():          # fx's tracer is not thread-safe
            warnings.simplefilter("ignore")
            gm = fx.symbolic_trace(score_mod)
    except Exception as e:  # noqa: BLE001 — any trace failure: not supported
        raise Unsupported(f"it does not trace ({type(e).__name__}: "
                          f"{(str(e).splitlines() or [''])[0][:160]})") from None
    last: Exception | None = None
    for i in (0, 1):
        interp = _Examples(gm)
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                interp.run(torch.zeros((), dtype=score_dtype),
                           *(torch.full((), i, dtype=torch.int64) for _ in range(4)))
            return gm, interp.values
        except Exception as e:  # noqa: BLE001
            last = e
    raise Unsupported(f"it fails on a 0-d example score ({type(last).__name__}: "
                      f"{(str(last).splitlines() or [''])[0][:160]})")


_LOCK = threading.Lock()
_LIBS: collections.OrderedDict[str, tuple[Any, int]] = collections.OrderedDict()
_FAILED: dict[str, str] = {}
_STATS: dict[str, Any] = {"builds": 0, "build_s": {}, "loads": 0, "traces": 0, "trace_s": 0.0,
                          "reused": 0}
_BY_CALL: weakref.WeakKeyDictionary[Any, dict[torch.dtype, CompiledScoreMod | str]] = (
    weakref.WeakKeyDictionary())
# (code, op signature, grad) -> (result, the captured tensors, kept alive so ids stay unique)
_TRACES: collections.OrderedDict[Any, tuple[CompiledScoreMod | str, list]] = (
    collections.OrderedDict())
_SCALARS = (int, float, bool, str, type(None), type(Ellipsis), torch.dtype, torch.device,
            torch.Size, torch.memory_format, torch.layout)
_FLAT = (torch.Tensor, slice, *_SCALARS)       # the leaves _flatten keys without pytree


def _flatten(args: tuple, kwargs: dict) -> tuple[list[Any], Any]:
    """An op's arguments as leaves and a key of their structure: flat arguments (tensors and
    scalars, the usual op) directly, anything nested through torch's pytree (whose
    flattening was two thirds of a small call's cost with a score_mod of three ops)."""
    leaves = [*args, *kwargs.values()]
    if all(isinstance(a, _FLAT) for a in leaves):
        return leaves, ("flat", len(args), tuple(kwargs))
    flat, spec = _compat.tree_flatten((args, kwargs))
    return flat, str(spec)


class _Signature(torch.overrides.TorchFunctionMode):
    """Records every torch call of one eager run on 0-d examples: the function, the Python
    values of its arguments, and where each tensor argument comes from (an input or an
    earlier result, by position; a captured tensor by identity, version, data pointer, shape
    and dtype). Two runs with equal signatures compute the same graph; the captured data the
    kernel reads is read per call (:meth:`CompiledScoreMod.bind`). What the trace folds into
    constants — the results of calls that no per-score value reaches (``table.long()``,
    ``torch.tensor(array)``) — is keyed by content: the captured tensors and NumPy arrays such
    a call reads are hashed (up to ``_CONTENT_LIMIT`` bytes each). Any other object argument,
    a larger one, or a random function makes the run ``reliable = False`` (not cached)."""

    def __init__(self, inputs: list[torch.Tensor]) -> None:
        super().__init__()
        self.known = {id(t): i for i, t in enumerate(inputs)}
        self.derived = {id(t) for t in inputs}           # reached by the per-score inputs
        self.keep: list[torch.Tensor] = list(inputs)     # ids stay unique during the run
        self.captured: list[torch.Tensor] = []
        self.ops: list[tuple] = []
        self.reliable = True

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat, spec = _flatten(args, kwargs)
        folded = not any(isinstance(a, torch.Tensor) and id(a) in self.derived for a in flat)
        if getattr(func, "__name__", "").strip("_") in _RANDOM:
            self.reliable = False                         # a new draw each call
        items: list[Any] = []
        for a in flat:
            if isinstance(a, torch.Tensor):
                k = self.known.get(id(a))
                if k is None:
                    self.captured.append(a)
                    items.append(("cap", id(a), a._version, a.data_ptr(), tuple(a.shape),
                                  a.dtype, a.requires_grad, self.digest(a) if folded else None))
                else:
                    items.append(("t", k))
            elif isinstance(a, slice):
                items.append(("slice", a.start, a.stop, a.step))
            elif isinstance(a, _SCALARS):
                items.append((type(a).__name__, a))
            elif type(a).__module__ == "numpy" and hasattr(a, "dtype"):
                items.append(("numpy", self.digest(a)))   # an array, or a NumPy scalar
            else:
                self.reliable = False                      # contents unknown: trace afresh
                items.append(("obj", type(a).__name__, id(a)))
        for t in (out,) if isinstance(out, torch.Tensor) else _compat.tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t) not in self.known:
                self.known[id(t)] = len(self.known)
                self.keep.append(t)
                if not folded:
                    self.derived.add(id(t))
        self.ops.append((func, spec, tuple(items)))
        return out

    def digest(self, a: Any) -> tuple | None:
        """Content key of a captured tensor or NumPy value (None + unreliable: too large)."""
        try:
            if isinstance(a, torch.Tensor):
                if a.device.type != "cpu" or a.numel() * a.element_size() > _CONTENT_LIMIT:
                    raise ValueError
                with _compat.torch_function_disabled():
                    raw = a.detach().reshape(-1).contiguous().view(torch.uint8).numpy()
                meta: tuple = (str(a.dtype), tuple(a.shape))
            else:
                import numpy as np
                arr = np.asarray(a)
                if arr.dtype.hasobject or arr.nbytes > _CONTENT_LIMIT:
                    raise ValueError
                raw, meta = np.ascontiguousarray(arr).reshape(-1).view(np.uint8), (
                    arr.dtype.str, arr.shape, type(a).__name__)
            return (*meta, hashlib.blake2b(memoryview(raw), digest_size=16).digest())
        except Exception:  # noqa: BLE001 — no content key: not cached
            self.reliable = False
            return None


_RANDOM = {"rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm",
           "normal", "bernoulli", "multinomial", "poisson", "uniform", "random",
           "exponential", "geometric", "cauchy", "log_normal"}


def _signature(fn: Any, score_dtype: torch.dtype) -> tuple[tuple, list[torch.Tensor]] | None:
    """``fn``'s op signature on 0-d examples and the tensors it captured (None: it failed, or
    it reads something whose contents the signature cannot key: trace it afresh)."""
    inputs = [torch.zeros((), dtype=score_dtype)] + [torch.zeros((), dtype=torch.int64)
                                                       for _ in range(4)]
    mode = _Signature(inputs)
    try:
        with torch.no_grad(), warnings.catch_warnings(), mode:
            warnings.simplefilter("ignore")
            out = fn(*inputs)
        sig = (tuple(mode.ops), mode.known.get(id(out), -1))
        hash(sig)
    except Exception:  # noqa: BLE001 — no signature: trace it afresh
        return None
    if not mode.reliable:
        return None
    return sig, mode.captured


def stats() -> dict[str, Any]:
    """Builds made (and their seconds, by source key: compile time reported apart), libraries
    loaded, traces and their total seconds, failed keys."""
    with _LOCK:
        return {**_STATS, "build_s": dict(_STATS["build_s"]), "cached": len(_LIBS),
                "failed": dict(_FAILED)}


def clear() -> None:
    """Forget the loaded libraries, failures and counters (tests); on-disk builds stay."""
    with _LOCK:
        _LIBS.clear()
        _FAILED.clear()
        _TRACES.clear()
        _STATS.update(builds=0, build_s={}, loads=0, traces=0, trace_s=0.0, reused=0)


def _build(name: str, source: str) -> int:
    """The address of ``attnkit_mod`` in the library built from ``source`` (cached)."""
    _, flags = loader.cpu_flags()
    cxx = loader.compiler()
    if cxx is None:
        why = (f"no C++ compiler found (CXX={os.environ.get('CXX', 'c++')!r}): install one "
               "(e.g. `apt-get install g++`) or point CXX at it")
        _fail("compiler", name, why)
    key = hashlib.sha256("\0".join([source, " ".join(_FLAGS + flags), str(cxx)]).encode()
                         ).hexdigest()[:20]
    with _LOCK:
        if key in _LIBS:
            _LIBS.move_to_end(key)
            return _LIBS[key][1]
        if key in _FAILED:
            raise Unsupported(_FAILED[key])
    so = loader.cache_dir() / "score_mod" / f"mod_{key}.so"

    def compile_into(tmp: Path) -> Path:                   # (under the library's lock)
        src, out = tmp / "mod.cpp", tmp / "mod.so"
        src.write_text(source)
        try:
            r = subprocess.run([cxx, *_FLAGS, *flags, "-o", str(out), str(src)],
                               capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:  # (TimeoutExpired: after 300 s)
            _fail(key, name, f"the C++ build failed ({type(e).__name__}: {e})")
        if r.returncode < 0:                               # killed (Ctrl-C, OOM): not its fault
            _fail(key, name, f"the C++ build was stopped by signal {-r.returncode}",
                  remember=False)
        if r.returncode:
            err = r.stderr.strip().splitlines()[-3:]
            _fail(key, name, f"the C++ build failed ({' | '.join(err)[-400:]})")
        return out

    t0 = time.perf_counter()
    try:
        built = loader.cached_library(so, compile_into, what=f"score_mod {name}")
    except loader.CacheError as e:
        _fail(key, name, str(e))
    if built:
        with _LOCK:
            _STATS["builds"] += 1
            _STATS["build_s"][key] = round(time.perf_counter() - t0, 3)
    try:
        lib = ctypes.CDLL(str(so))
        addr = ctypes.cast(lib.attnkit_mod, ctypes.c_void_p).value
    except (OSError, AttributeError) as e:
        _fail(key, name, f"loading the built library failed ({e})")
    with _LOCK:
        _STATS["loads"] += 1
        _LIBS[key] = (lib, int(addr))                      # type: ignore[arg-type]
        while len(_LIBS) > _CACHE_SIZE:
            _LIBS.popitem(last=False)
    return int(addr)                                       # type: ignore[arg-type]


def _fail(key: str, name: str, why: str, *, remember: bool = True) -> NoReturn:
    """Warn (once per ``key``) and raise :class:`Unsupported`; ``remember``: the key is not
    built again in this process (``False`` for an interrupted build: the next call retries)."""
    with _LOCK:
        first = key not in _FAILED
        if remember:
            _FAILED[key] = why
    if first:
        warnings.warn(f"attnkit: could not build score_mod {name} for the native kernel: {why}; "
                      "using the Python path for it (correct, slower)", RuntimeWarning,
                      stacklevel=4)
    raise Unsupported(why)


def _tables(gm: Any) -> Any:
    """``distance_tables(gm)``, or None where the analysis fails: the tables only make the
    build faster, so losing them must not cost the call its native path."""
    try:
        return distance_tables(gm)
    except Exception:  # noqa: BLE001 — no tables: every node per key, as before
        return None


def compile_score_mod(fn: Any, *, grad: bool | None = None,
                      dtype: torch.dtype = torch.float32,
                      extent: int | None = None) -> CompiledScoreMod:
    """``fn(score, b, h, q_idx, kv_idx)`` traced, generated, built and loaded; raises
    :class:`Unsupported` (with the reason) when it cannot be. ``grad`` (default: autograd is
    recording) refuses captured tensors that require grad. ``dtype``: the kernel's compute
    dtype — float32 (for float32 / bfloat16 / float16 inputs) or float64. ``extent``: the
    largest of batch, heads, queries and keys of the calls it is for: up to
    ``POSITION_LIMIT``, a score_mod that reads positions is built with its narrow (int32)
    variant only — the int64 one is built when a larger call binds it
    (:meth:`CompiledScoreMod.bind`); None (default): both at once."""
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64 (the kernel's compute "
                         f"dtypes), got {dtype}")
    name = fn_name(fn)
    user = fn.fn if isinstance(fn, ScoreTerm) else fn
    t0 = time.perf_counter()
    gm, examples = _trace(user, dtype)
    grad = torch.is_grad_enabled() if grad is None else grad
    gen = Gen(gm, examples, grad, dtype)
    out = gen.run()
    narrow = None
    if uses_positions(gm):                                 # + the int32-position variant
        ng = Gen(gm, examples, grad, dtype, limit=POSITION_LIMIT, tables=_tables(gm))
        narrow = (ng, ng.run())
    src = source(gen, out, narrow)
    lazy = narrow is not None and extent is not None and extent <= POSITION_LIMIT
    with _LOCK:
        _STATS["traces"] += 1
        _STATS["trace_s"] += time.perf_counter() - t0
    if not lazy:
        return CompiledScoreMod(name, _build(name, src), gen.caps, gen.cap_stores, dtype)
    addr = _build(name, source(gen, out, narrow, wide=False))
    return CompiledScoreMod(name, addr, gen.caps, gen.cap_stores, dtype,
                            limit=POSITION_LIMIT, full_source=src)


def for_problem(score_mod: Any, dtype: torch.dtype = torch.float32,
                extent: int | None = None) -> CompiledScoreMod | str:
    """The compiled form of a call's ``score_mod`` (api's checked wrapper, or a raw
    function) for the kernel's compute ``dtype`` (float32 or float64), or the reason it has
    none — remembered per wrapper object (one per call) and dtype. ``extent``: the call's
    largest of batch, heads, queries and keys (None: any), which the result serves (see
    :func:`compile_score_mod`; an earlier narrow build is widened here, where a failed
    build still leaves the call its Python path)."""
    if torch.compiler.is_compiling():
        return "inside torch.compile (the score_mod runs on the Python path there)"
    per_call = unwrap(score_mod) is not score_mod         # api's wrapper: one per call
    got = None
    with _LOCK, contextlib.suppress(TypeError):           # not weak-referenceable
        got = _BY_CALL.get(score_mod, {}).get(dtype) if per_call else None
    if got is not None:
        return _serving(got, extent)
    fn = unwrap(score_mod)
    user = fn.fn if isinstance(fn, ScoreTerm) else fn
    signed = _signature(user, dtype)
    key = None if signed is None else (getattr(user, "__code__", user), signed[0],
                                       torch.is_grad_enabled(), dtype)
    if key is not None:
        with _LOCK:
            hit = _TRACES.get(key)
            if hit is not None:
                _TRACES.move_to_end(key)
                _STATS["reused"] += 1
        if hit is not None:
            return _serving(_remember(score_mod, per_call, hit[0], dtype), extent)
    try:
        got = compile_score_mod(fn, dtype=dtype, extent=extent)
    except Unsupported as e:
        got = str(e)
    except Exception as e:  # noqa: BLE001 — never worse than the Python path
        got = f"compiling it failed ({type(e).__name__}: {e})"
        warnings.warn(f"attnkit: the native score_mod compiler failed on {fn_name(fn)} "
                      f"({got}); using the Python path for it", RuntimeWarning, stacklevel=3)
    if key is not None:
        with _LOCK:
            _TRACES[key] = (got, signed[1])               # type: ignore[index]
            while len(_TRACES) > _CACHE_SIZE:
                _TRACES.popitem(last=False)
    return _remember(score_mod, per_call, got, dtype)


def _serving(got: CompiledScoreMod | str, extent: int | None) -> CompiledScoreMod | str:
    """``got``, widened first where its narrow build does not serve ``extent``; the reason
    as a string when that build fails (the call runs its Python path)."""
    if isinstance(got, str) or got.serves(extent):
        return got
    try:
        got.widen()
    except Unsupported as e:
        return str(e)
    return got


def _remember(score_mod: Any, per_call: bool, got: CompiledScoreMod | str,
              dtype: torch.dtype) -> CompiledScoreMod | str:
    if per_call:
        with _LOCK, contextlib.suppress(TypeError):        # not weak-referenceable
            _BY_CALL.setdefault(score_mod, {})[dtype] = got
    return got
