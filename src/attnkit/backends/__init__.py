"""Backends and the one priority list that picks among them.

What lives where::

    base.py         Problem (the one layout), Backend, Capabilities (what a backend supports,
                    as data) and the shared primitives: softmax_shift, finish, merge_partials,
                    refuse_double_backward, compute_dtype
    ../reference.py the formula, materialised (supports everything; the oracle)
    decode.py       few queries over a long K/V cache (key chunks merged by LSE), CPU
    tiled/          the CPU engine (block plan, fused/windowed/general schedules, backward)
    native/         attnkit's compiled CPU kernels, used by tiled and decode
    triton.py       fused GPU kernels (forward + backward), _triton_kernels.py their source

Each backend is a :class:`~attnkit.backends.base.Backend` with a name, declared
:class:`~attnkit.backends.base.Capabilities`, its own ``extra_reasons(problem)`` and a
``forward(problem)``. ``backend="auto"`` takes the first backend in :data:`PRIORITY` that
reports no reasons (asked as ``can_run(problem)``, which a backend may answer without
building the reasons' text). A forced backend that cannot run raises ``ValueError`` with its
reasons; when nothing fits, the error describes the call once and then gives every
backend's reasons, one line each.

:func:`use` chooses backends for a scope, as ``torch.nn.attention.sdpa_kernel`` does for
SDPA: ``with use("tiled"): ...`` makes every ``backend="auto"`` call inside — from
:func:`attnkit.attention`, :func:`attnkit.scaled_dot_product_attention`, the layers, the
transformers integration — run as ``backend="tiled"``; ``use(["decode", "tiled"])`` lets
``auto`` pick among those names only, in that order. The choice lives in a
:class:`contextvars.ContextVar`: it belongs to the thread or asyncio task that entered the
scope (a new thread starts without it; an asyncio task starts with its creator's), and
leaving the scope — also by an exception — restores the choice before it. A named
``backend=`` argument wins over the scope.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterable, Iterator
from contextvars import ContextVar

from ..reference import ReferenceBackend
from .base import Backend, Problem

__all__ = ["Backend", "Problem", "register", "get", "names", "select", "check_name", "use",
           "current", "PRIORITY", "REGISTRY"]

REGISTRY: dict[str, Backend] = {}
#: The order ``backend="auto"`` tries, fastest first. The reference is last: it supports
#: everything. A built-in backend whose module cannot be imported is left out (see below).
PRIORITY: list[str] = ["triton", "decode", "tiled", "reference"]


def register(backend: Backend, *, before: str | None = None) -> None:
    """Add (or replace) a backend in the registry.

    A name already in :data:`PRIORITY` keeps its place unless ``before`` is given; a new
    name goes before ``before`` (default: just ahead of the reference).
    """
    REGISTRY[backend.name] = backend
    if backend.name in PRIORITY:
        if before is None:
            return
        PRIORITY.remove(backend.name)
    anchor = before if before in PRIORITY else ("reference" if "reference" in PRIORITY else None)
    PRIORITY.insert(PRIORITY.index(anchor) if anchor else len(PRIORITY), backend.name)


def names() -> list[str]:
    """Backend names accepted by ``attention(backend=...)``, besides ``"auto"``."""
    return list(REGISTRY)


def check_name(name: object, *, what: str = "backend") -> str:
    """``name`` if it is ``"auto"`` or a registered backend, else a clear error (the one check
    every entry point uses)."""
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a string, got {type(name).__name__}")
    if name != "auto" and name not in REGISTRY:
        raise ValueError(
            f"unknown {what} {name!r}: choose one of "
            f"{', '.join(repr(n) for n in ['auto', *REGISTRY])}"
        )
    return name


def get(name: str) -> Backend:
    return REGISTRY[name]


# ------------------------------------------------------------------ the scoped choice
#: The backends chosen by the innermost :func:`use` scope of this context (thread, asyncio
#: task), as a tuple of names in priority order; None outside any scope (plain ``auto``).
_SCOPE: ContextVar[tuple[str, ...] | None] = ContextVar("attnkit_backend_scope", default=None)


def _scope_names(backends: str | Iterable[str]) -> tuple[str, ...] | None:
    """``use``'s argument checked → a tuple of registered names (None for ``"auto"``)."""
    if isinstance(backends, str):
        chosen: tuple[object, ...] = (backends,)
    elif isinstance(backends, Iterable):
        chosen = tuple(backends)
    else:
        raise TypeError(f"attnkit.backends.use takes a backend name or a list of names, got "
                        f"{type(backends).__name__}: e.g. use('tiled') or use(['decode', "
                        "'tiled'])")
    if not chosen:
        raise ValueError("attnkit.backends.use needs at least one backend name: choose from "
                         + ", ".join(repr(n) for n in REGISTRY))
    for n in chosen:
        check_name(n)
    if "auto" in chosen:
        if len(chosen) > 1:
            raise ValueError(f"'auto' stands alone in attnkit.backends.use (it means every "
                             f"backend, in PRIORITY order), got {list(chosen)!r}")
        return None
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"attnkit.backends.use got a name twice: {list(chosen)!r}")
    return chosen  # type: ignore[return-value]


def use(backends: str | Iterable[str]) -> contextlib.AbstractContextManager[tuple[str, ...]]:
    """Choose the backends of every ``backend="auto"`` call inside a ``with`` block::

        with attnkit.backends.use("tiled"):                # as backend="tiled"
            out = model(x)
        with attnkit.backends.use(["decode", "tiled"]):    # auto, among these, in this order
            ...
        with attnkit.backends.use("auto"):                 # every backend again (inner scope)
            ...

    ``backends`` is a name from :func:`names` or a list of them in priority order; the names
    are checked here (an unknown one raises ``ValueError`` listing the names). Inside the
    scope one name behaves exactly as ``backend=`` that name — a call it cannot run raises
    the same ``ValueError`` with its reasons, never a silent fallback — and a list as
    ``auto`` over those names only (the error lists each one's reasons). A named
    ``backend=`` argument wins over the scope; ``backend="auto"`` (the default) means the
    scope. The choice is per context (:class:`contextvars.ContextVar`): other threads never
    see it, asyncio tasks created inside inherit it, scopes nest (the innermost wins) and
    leaving one — also by an exception — restores the choice before it. The ``with`` block
    yields the chosen names (``()`` for ``"auto"``). Also usable as a decorator.

    Under ``torch.compile`` / ``torch.export``: the compiled graph holds the operator
    ``attnkit::attention`` with ``backend="auto"``, whose implementation runs eagerly when
    the graph runs, so the scope in effect *at run time* chooses (enter it around the call
    of the compiled function, not inside the function being compiled).
    """
    return _scope(_scope_names(backends))


@contextlib.contextmanager
def _scope(chosen: tuple[str, ...] | None) -> Iterator[tuple[str, ...]]:
    token = _SCOPE.set(chosen)
    try:
        yield chosen or ()
    finally:
        _SCOPE.reset(token)


def current() -> tuple[str, ...] | None:
    """The names chosen by the innermost :func:`use` scope here, or None (plain ``auto``)."""
    return _SCOPE.get()


def select(p: Problem, name: str = "auto") -> Backend:
    """The backend that will run ``p``: the named one, or — for ``"auto"`` — the first in
    priority that fits (among the names of the enclosing :func:`use` scope, if any)."""
    check_name(name)
    scope = None
    if name == "auto":
        scope = _SCOPE.get()
        if scope is not None and len(scope) == 1:
            name = scope[0]
    if name != "auto":
        b = REGISTRY.get(name)
        if b is None:                            # (removed since the scope was entered)
            check_name(name)
        reasons = b.not_supported_reasons(p)  # type: ignore[union-attr]
        if reasons:
            fix = ("Use backend='auto' to pick one that can." if scope is None else
                   f"It was chosen by attnkit.backends.use({name!r}): leave that scope, or "
                   "give the call backend=... (or the scope a list of names) to pick another.")
            raise ValueError(
                f"backend {name!r} cannot run this call: " + "; ".join(reasons) + ".\n"
                f"  the call: {p.describe()}\n" + fix
            )
        return b  # type: ignore[return-value]
    order = PRIORITY if scope is None else scope
    for n in order:
        b = REGISTRY.get(n)
        if b is not None and b.can_run(p):
            return b
    lines = [f"  {n}: " + "; ".join(REGISTRY[n].not_supported_reasons(p))
             for n in order if n in REGISTRY]
    if scope is None:
        raise ValueError(f"no backend can run this call ({p.describe()}):\n" + "\n".join(lines))
    raise ValueError(f"no backend of attnkit.backends.use({list(scope)!r}) can run this call "
                     f"({p.describe()}):\n" + "\n".join(lines))


def _load(module: str, cls: str) -> None:
    """Import a built-in backend and register it; one whose module (or whose dependency,
    e.g. triton) is absent is left out of :data:`PRIORITY`."""
    try:
        backend = getattr(importlib.import_module(f"{__name__}.{module}"), cls)()
    except ModuleNotFoundError as e:
        if e.name not in (f"{__name__}.{module}", "triton"):
            raise
        name = module
        if name in PRIORITY and name not in REGISTRY:
            PRIORITY.remove(name)
        return
    register(backend)


register(ReferenceBackend())
for _module, _cls in (("decode", "DecodeBackend"), ("tiled", "TiledBackend"),
                      ("triton", "TritonBackend")):
    _load(_module, _cls)
