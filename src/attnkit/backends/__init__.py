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
"""

from __future__ import annotations

import importlib

from ..reference import ReferenceBackend
from .base import Backend, Problem

__all__ = ["Backend", "Problem", "register", "get", "names", "select", "check_name", "PRIORITY",
           "REGISTRY"]

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


def select(p: Problem, name: str = "auto") -> Backend:
    """The backend that will run ``p``: the named one, or the first in priority that fits."""
    check_name(name)
    if name != "auto":
        reasons = REGISTRY[name].not_supported_reasons(p)
        if reasons:
            raise ValueError(
                f"backend {name!r} cannot run this call: " + "; ".join(reasons) + ".\n"
                f"  the call: {p.describe()}\n"
                "Use backend='auto' to pick one that can."
            )
        return REGISTRY[name]
    for n in PRIORITY:
        b = REGISTRY.get(n)
        if b is not None and b.can_run(p):
            return b
    lines = [f"  {n}: " + "; ".join(REGISTRY[n].not_supported_reasons(p))
             for n in PRIORITY if n in REGISTRY]
    raise ValueError(f"no backend can run this call ({p.describe()}):\n" + "\n".join(lines))


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
