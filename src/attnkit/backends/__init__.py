"""Backends and the one priority list that picks among them.

Each backend is a :class:`~attnkit.backends.base.Backend` with a name, a
``not_supported_reasons(problem)`` and a ``forward(problem)``. ``backend="auto"`` takes the
first backend in :data:`PRIORITY` that reports no reasons; a forced backend that cannot run
raises ``ValueError`` listing its reasons, and when nothing fits the error lists every
backend's reasons.
"""

from __future__ import annotations

import importlib

from ..reference import ReferenceBackend
from .base import Backend, Problem

__all__ = ["Backend", "Problem", "register", "get", "names", "select", "check_name", "PRIORITY",
           "REGISTRY"]

REGISTRY: dict[str, Backend] = {}
# Fastest first; "auto" walks this list. The reference is last: it supports everything.
PRIORITY: list[str] = []


def register(backend: Backend, *, before: str | None = None) -> None:
    """Add a backend to the registry, placed before ``before`` in the priority list
    (default: just ahead of the reference)."""
    REGISTRY[backend.name] = backend
    if backend.name in PRIORITY:
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
                f"backend {name!r} cannot run this call: " + "; ".join(reasons)
                + ". Use backend='auto' to pick one that can."
            )
        return REGISTRY[name]
    all_reasons = []
    for n in PRIORITY:
        reasons = REGISTRY[n].not_supported_reasons(p)
        if not reasons:
            return REGISTRY[n]
        all_reasons.append(f"{n}: " + "; ".join(reasons))
    raise ValueError("no backend can run this call — " + " | ".join(all_reasons))


register(ReferenceBackend())

# Optional fast backends register themselves ahead of the reference when they import;
# one whose module (or whose dependency, e.g. triton) is absent is simply not listed.
for _mod in ("decode", "tiled", "triton"):
    try:
        importlib.import_module(f"{__name__}.{_mod}")
    except ModuleNotFoundError as _e:
        if _e.name not in (f"{__name__}.{_mod}", "triton"):
            raise
