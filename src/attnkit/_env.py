"""Switches read from the environment at every call, cheaply (the hot path reads two).

``os.environ.get`` of an unset name costs ~3 µs (a ``KeyError`` inside ``Mapping.get``); a
small decode call reads ``ATTNKIT_NATIVE`` and ``TRITON_INTERPRET`` each time, since tests
and users flip them at run time. On POSIX :func:`switch` looks the name up in
``os.environ``'s own dict (the one ``os.environ[...] =``, ``putenv`` through it and
``monkeypatch.setenv`` write) in ~0.1 µs and caches the parse per raw value; elsewhere, or
when ``os.environ`` has been replaced, it asks ``os.environ.get``.
"""

from __future__ import annotations

import os

_ENVIRON = os.environ
_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None
_PARSED: dict[tuple[str, bytes | str | None, bool], bool] = {}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "off", "no")


def switch(name: str, default: bool) -> bool:
    """The boolean switch ``name`` (1/true/yes/on, 0/false/off/no, any case; unset or
    anything else → ``default``), read now."""
    env = os.environ
    if env is _ENVIRON and _DATA is not None:
        raw: bytes | str | None = _DATA.get(name.encode())
    else:
        raw = env.get(name)
    key = (name, raw, default)
    got = _PARSED.get(key)
    if got is None:
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else (raw or "")
        text = text.strip().lower()
        got = _PARSED[key] = (True if text in _TRUE else False if text in _FALSE
                              else default)
    return got
