"""Build-on-first-use loader for attnkit's native CPU kernel (``attention.cpp``).

The C++ source is compiled once, through ``torch.utils.cpp_extension.load`` (ninja + the
system C++ compiler), into the user's cache directory::

    $ATTNKIT_CACHE_DIR  or  $XDG_CACHE_HOME/attnkit  or  ~/.cache/attnkit
        native/<key>/          key = hash(torch version, Python, source, CPU flags, compiler)
            attnkit_native_<key>.so  (+ .so.sha256: its size and checksum; .lock: the build lock)

so a new torch, an edited source or another CPU gets its own build, and every later process
loads the cached library in milliseconds. The vector flags come from the CPU
(``/proc/cpuinfo``): AVX-512 where present (with AVX512-BF16's instructions where the CPU
has them too), else AVX2 + FMA, else a portable build.

Anything that stops the kernel — ``ATTNKIT_NATIVE=0``, no compiler, no ninja, a failed build,
an unsupported platform — leaves :func:`load` returning ``None`` and :func:`reason` saying why
and how to fix it; one warning is issued per process (none for ``ATTNKIT_NATIVE=0``, which
is a choice, not a problem).

Caution
-------
- The first build takes about 15 s of one core (``attention.cpp`` is one translation unit
  that includes only ATen's core headers, ``ATen/native/CPUBlas.h`` and ``torch/library.h``).
  It prints one line when it starts and one with the time it took, on stderr.
- A cached library is loaded only when it matches the size and SHA-256 written beside it
  (``<name>.so.sha256``) after a complete build, so a truncated or damaged file (a full disk,
  a killed copy) is rebuilt, with one ``RuntimeWarning``, instead of crashing the process
  (``SIGBUS``) when it is mapped. A verified build loads without writing anything, so a
  read-only cache works. The same check guards the compiled score_mods (``score_mod.py``).
- Builds are serialised by an ``flock`` on ``<name>.lock`` beside the library, which the OS
  releases when its holder dies (``SIGTERM``, ``SIGKILL``, a crash), so a killed build never
  blocks later ones; each build runs in a fresh staging folder beside it (torch's own lock
  file lives there and dies with it) and is published by an atomic rename. A process that
  waits says so on stderr after 5 s, naming the lock and the holder's pid, and gives up after
  ``_WAIT_S`` (10 min) with the fallback warning.
- A failed build is remembered in ``native/<key>/failed`` (the reason and the compiler's
  output), so later processes fall back at once with one warning instead of compiling again:
  delete that file (or the folder) to retry; a new key (torch, compiler, flags, source) builds
  afresh. An interrupted build (Ctrl-C, a compiler killed by a signal or out of memory) is
  not remembered, and ``KeyboardInterrupt`` / ``SystemExit`` reach the caller (the next call
  tries again).
- Threads come from torch's intra-op pool (``at::parallel_for``), which needs OpenMP in the
  extension's own build: on Linux it is built with ``-fopenmp``; elsewhere it runs on one
  thread.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

try:
    import fcntl
except ImportError:  # Windows: no flock (the native kernel does not build there anyway)
    fcntl = None  # type: ignore[assignment]

__all__ = ["load", "hot_state", "reason", "reset", "cpu_flags", "cache_dir", "compiler",
           "build_key", "SOURCES", "verify_library", "cached_library", "CacheError"]

SOURCES: list[Path] = [Path(__file__).with_name("attention.cpp")]
_OPT_FLAGS = ["-O3", "-fno-math-errno"]
# at::parallel_for is an inline template: without OpenMP in *this* build it runs serially.
# (The library then uses the libgomp.so.1 torch has already loaded.)
_OMP_FLAGS = ["-fopenmp"] if sys.platform.startswith("linux") else []
_lock = threading.Lock()
_WAIT_S = 600.0       # the longest a process waits for another's build of the same library
_SAY_S = 5.0          # ... and when it says that it waits
_state: dict[str, object] = {"tried": False, "ops": None, "reason": None, "warned": False,
                             "loaded_key": None}


class NativeUnavailableWarning(UserWarning):
    """The native kernel could not be used; attnkit runs its Python path instead."""


_LEVELS = ("portable", "avx2", "avx512", "avx512bf16")   # narrowest first
_AVX512 = ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
_LEVEL_FLAGS = {"portable": [], "avx2": ["-mavx2", "-mfma", "-mf16c"], "avx512": _AVX512,
                "avx512bf16": [*_AVX512, "-mavx512bf16"]}  # (vcvtneps2bf16, vdpbf16ps)


def cpu_flags() -> tuple[str, list[str]]:
    """``(level, compiler flags)`` for this CPU: ``avx512bf16``, ``avx512``, ``avx2`` or
    ``portable``.

    ``ATTNKIT_NATIVE_ISA=avx2`` (or ``portable``) builds a narrower kernel than the CPU could
    run — to test on one machine the code another CPU takes; a level above the CPU's is
    refused (a clear error at the first call, then the Python path)."""
    level = _detected_level()
    want = os.environ.get("ATTNKIT_NATIVE_ISA", "").strip().lower()
    if want:
        if want not in _LEVELS:
            raise _Unavailable(f"ATTNKIT_NATIVE_ISA={want!r} is not one of "
                               f"{', '.join(_LEVELS)}: unset it, or pick one")
        if _LEVELS.index(want) > _LEVELS.index(level):
            raise _Unavailable(f"ATTNKIT_NATIVE_ISA={want!r} is above what this CPU runs "
                               f"({level!r}): unset it, or pick a narrower level")
        level = want
    return level, list(_LEVEL_FLAGS[level])


def _detected_level() -> str:
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return "portable"
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        return "portable"
    avx2 = {"avx2", "fma", "f16c"}
    if avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "avx512bf16" if "avx512_bf16" in flags else "avx512"
    if avx2 <= flags:
        return "avx2"
    return "portable"


def cache_dir() -> Path:
    """Where builds are cached (see the module docstring)."""
    if os.environ.get("ATTNKIT_CACHE_DIR"):
        return Path(os.environ["ATTNKIT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnkit"


def compiler() -> str | None:
    """The C++ compiler builds use: ``$CXX``, else ``c++`` or ``g++`` on PATH (None: none)."""
    cxx = os.environ.get("CXX", "c++")
    return shutil.which(cxx) or (None if os.environ.get("CXX") else shutil.which("g++"))


_compiler = compiler


def build_key(flags: list[str], compiler: str) -> str:
    """Hash of everything a build depends on (torch, Python, source, flags, compiler)."""
    h = hashlib.sha256()
    h.update(f"{torch.__version__}|{sys.version_info[:2]}|{compiler}|".encode())
    h.update(" ".join(_OPT_FLAGS + _OMP_FLAGS + flags).encode())
    for src in SOURCES:                                  # the .cpp and the headers beside it
        h.update(src.read_bytes())
        for header in sorted(src.parent.glob("*.h")):
            h.update(header.read_bytes())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------ the build cache
class CacheError(RuntimeError):
    """A library could not be built into (or loaded from) the cache: the folder cannot be
    written, or another process's build did not finish in time. The message says why."""


def _manifest(so: Path) -> Path:
    return so.with_name(so.name + ".sha256")


def _digest(path: Path) -> tuple[int, str]:
    data = path.read_bytes()
    return len(data), hashlib.sha256(data).hexdigest()


def verify_library(so: Path) -> str | None:
    """``None`` when ``so`` is a complete library — its size and SHA-256 are those written
    beside it (``<so>.sha256``) when it was published — else why it is not. Never maps it:
    a truncated library kills the process that maps it (``SIGBUS``)."""
    try:
        want = json.loads(_manifest(so).read_text())
        size, sha = int(want["size"]), str(want["sha256"])
    except FileNotFoundError:
        return "missing" if not so.exists() else "unverified (no checksum beside it)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its checksum file is unreadable ({type(e).__name__}: {e})"
    try:
        got_size, got_sha = _digest(so)
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"unreadable ({e})"
    if got_size != size:
        return f"damaged: {got_size} bytes where {size} were written (truncated?)"
    if got_sha != sha:
        return "damaged: its SHA-256 differs from the one written when it was built"
    return None


def _publish(built: Path, so: Path) -> None:
    """Move the finished ``built`` to ``so`` (atomic rename) and write its checksum."""
    with open(built, "rb") as f:
        os.fsync(f.fileno())
    size, sha = _digest(built)
    manifest = _manifest(so)
    with contextlib.suppress(FileNotFoundError):   # stopped before the end: "unverified"
        manifest.unlink()
    os.replace(built, so)
    tmp = manifest.with_name(f"{manifest.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"size": size, "sha256": sha}) + "\n")
    os.replace(tmp, manifest)


def _holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "unknown"
    except OSError:
        return "unknown"


def _unwritable(folder: Path, e: OSError, what: str, so: Path, bad: str) -> CacheError:
    state = "" if bad == "missing" else f"its cached library {so} is {bad}, and "
    return CacheError(f"{what} needs a build: {state}the cache folder {folder} cannot be "
                      f"written ({e}); set ATTNKIT_CACHE_DIR to a writable folder")


@contextlib.contextmanager
def _flock(path: Path, what: str, wait_s: float) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (the OS releases it if this process dies).
    A wait says so on stderr after ``_SAY_S`` and raises :class:`CacheError` after ``wait_s``."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        t0, said = time.monotonic(), False
        while fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            except OSError as e:     # no flock on this file system (some NFS): go unlocked
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    break
                raise
            waited = time.monotonic() - t0
            if waited >= wait_s:
                raise CacheError(
                    f"gave up after {waited:.0f} s waiting for another process (pid "
                    f"{_holder(path)}) that holds {path} while it builds {what}; if that "
                    "process is stuck, stop it (the lock goes with it)")
            if not said and waited >= _SAY_S:
                said = True
                print(f"attnkit: waiting for another process (pid {_holder(path)}) to finish "
                      f"building {what} (lock {path}; at most {wait_s:.0f} s)...",
                      file=sys.stderr, flush=True)
            time.sleep(0.1)
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)


def cached_library(so: Path, build: Callable[[Path], Path], *, what: str,
                   wait_s: float | None = None) -> bool:
    """Make ``so`` a verified library (see :func:`verify_library`); ``False`` when it already
    was (nothing is written: a read-only cache works). Else, holding the ``flock`` on
    ``<so stem>.lock`` (checked again once held: another process may have built it meanwhile),
    ``build(staging)`` makes the library in a fresh folder beside ``so`` and returns its
    path, which is published (checksum + atomic rename); returns ``True``. Whatever ``build``
    raises propagates; an unwritable folder or a wait past ``wait_s`` (default ``_WAIT_S``)
    raises :class:`CacheError`."""
    bad = verify_library(so)
    if bad is None:
        return False
    held = contextlib.ExitStack()
    try:
        so.parent.mkdir(parents=True, exist_ok=True)
        held.enter_context(_flock(so.with_name(so.stem + ".lock"), what,
                                  _WAIT_S if wait_s is None else wait_s))
    except OSError as e:
        raise _unwritable(so.parent, e, what, so, bad) from None
    with held:
        bad = verify_library(so)
        if bad is None:
            return False                                   # built while this one waited
        if bad.startswith("damaged"):
            warnings.warn(f"attnkit: the cached library of {what} ({so}) is {bad}; rebuilding it",
                          RuntimeWarning, stacklevel=3)
        for old in so.parent.glob(f"{so.stem}.build-*"):   # left by builds that were killed
            shutil.rmtree(old, ignore_errors=True)
        try:
            staging = Path(tempfile.mkdtemp(prefix=f"{so.stem}.build-", dir=so.parent))
        except OSError as e:
            raise _unwritable(so.parent, e, what, so, bad) from None
        try:
            built = build(staging)
            try:
                _publish(built, so)
            except OSError as e:
                raise CacheError(f"{what} was built but could not be saved as {so} ({e})"
                                 ) from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return True


def _unsupported_platform() -> str | None:
    if sys.platform == "win32":
        return ("the native kernel uses GCC/Clang vector extensions, which MSVC lacks "
                "(Windows is not supported yet)")
    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        return f"CPU architecture {platform.machine()!r} is not supported (x86-64 or ARM64)"
    return None


def _find_ninja() -> tuple[str | None, str | None]:
    """``(reason it cannot build, or None; a folder to put on PATH for the build, or None)``:
    ninja on PATH, or PyPI ninja's binary when it is installed but not on PATH."""
    if shutil.which("ninja"):
        return None, None
    try:
        import ninja  # type: ignore[import-not-found]
    except ImportError:
        return ("ninja is not installed: `pip install ninja` (needed to build the native "
                "kernel)"), None
    if shutil.which("ninja", path=ninja.BIN_DIR) is None:
        return "ninja is installed but cannot be run", None
    return None, ninja.BIN_DIR


@contextlib.contextmanager
def _build_environment(compiler: str, ninja_dir: str | None) -> Iterator[None]:
    """``CXX`` (and ``PATH``, for ninja) as torch's extension builder reads them, for the
    build only: the process's environment is given back as it was (under the build lock)."""
    saved = {name: os.environ.get(name) for name in ("CXX", "PATH")}
    os.environ["CXX"] = compiler
    if ninja_dir is not None:
        os.environ["PATH"] = ninja_dir + os.pathsep + (saved["PATH"] or "")
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _build() -> object:
    """Load the verified cached build of attention.cpp, or compile it (see the module
    docstring); returns torch.ops.attnkit_native."""
    missing_src = [str(s) for s in SOURCES if not s.exists()]
    if missing_src:
        raise _Unavailable(f"the kernel's C++ sources are missing from this install "
                           f"({', '.join(missing_src)}): reinstall attnkit with its package "
                           "data (attnkit/backends/native/*.cpp, *.h)")
    level, flags = cpu_flags()
    compiler = _compiler()
    if compiler is None:
        raise _Unavailable(f"no C++ compiler found (CXX={os.environ.get('CXX', 'c++')!r}): "
                           "install one (e.g. `apt-get install g++`) or point CXX at it")
    missing, ninja_dir = _find_ninja()
    if missing:
        raise _Unavailable(missing)
    key = build_key(flags, compiler)
    if _state.get("loaded_key") is not None:
        # One library per process: a second TORCH_LIBRARY("attnkit_native") would abort.
        # A build that changed since (new source, flags) takes effect in a new process.
        return torch.ops.attnkit_native
    folder = cache_dir() / "native" / key
    name = f"attnkit_native_{key}"
    so = folder / f"{name}.so"
    failed = folder / "failed"
    loaded: list[str] = []

    def compile_into(staging: Path) -> Path:
        # imported for a build only: it imports setuptools (~0.2 s), which a process that
        # loads the cached library does not need
        from torch.utils import cpp_extension

        if failed.exists():                                # another process failed meanwhile
            raise _Unavailable(_failed_before(failed))
        print(f"attnkit: compiling the native CPU kernel ({level}) into {folder} "
              "(first use only, ~15 s)...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            with _build_environment(compiler, ninja_dir):
                cpp_extension.load(name=name, sources=[str(s) for s in SOURCES],
                                   extra_cflags=[*_OPT_FLAGS, *_OMP_FLAGS, *flags],
                                   extra_ldflags=list(_OMP_FLAGS),  # (torch appends to these)
                                   build_directory=str(staging),
                                   is_python_module=False, verbose=False)
        except Exception as e:  # noqa: BLE001 — any build failure means "unavailable"
            text = str(e).strip()
            tail = " | ".join(text.splitlines()[-4:])[-600:]
            why = f"the native kernel failed to build ({tail})"
            if _interrupted(e):
                raise _Unavailable(f"{why}; it was interrupted and is tried again in the "
                                   "next process") from e
            shutil.rmtree(staging, ignore_errors=True)     # (room for the note on a full disk)
            with contextlib.suppress(OSError):
                failed.write_text(f"{why}\n\n{text[-8000:]}\n")
            raise _Unavailable(f"{why}; {_NO_RETRY.format(failed=failed)}") from e
        loaded.append(name)
        print(f"attnkit: native CPU kernel built in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)
        # (a retry in this process gets torch's name_v1: the staging folder holds one .so)
        return next(staging.glob(f"{name}*.so"))

    if failed.exists() and verify_library(so) is not None:
        raise _Unavailable(_failed_before(failed))
    try:
        cached_library(so, compile_into, what="the native CPU kernel")
    except CacheError as e:
        if not loaded:
            raise _Unavailable(str(e)) from None
        warnings.warn(f"attnkit: {e}; it is used in this process and built again in the "
                      "next", RuntimeWarning, stacklevel=4)
    if not loaded:                                         # verified: load it (no writes)
        try:
            torch.ops.load_library(str(so))
        except OSError as e:
            raise _Unavailable(f"the cached native kernel {so} failed to load ({e}); delete "
                               f"{folder} to rebuild it") from e
    _state["loaded_key"] = key
    _state["loaded_level"] = level
    return torch.ops.attnkit_native


_NO_RETRY = ("later processes do not try again (recorded in {failed}): fix the cause and "
             "delete that file to retry")


def _failed_before(failed: Path) -> str:
    try:
        why = (failed.read_text().splitlines() or ["(no reason recorded)"])[0]
    except OSError as e:
        why = f"(its reason is unreadable: {e})"
    return (f"{why} — in an earlier run, recorded in {failed}; delete that file to try "
            "again (a new torch, compiler or attnkit source builds afresh anyway)")


def _interrupted(e: BaseException) -> bool:
    """Whether a failed build was stopped from outside (Ctrl-C, a signal, out of memory)
    rather than failing on its own: such a build is not remembered as failed."""
    cause = e.__cause__
    if isinstance(cause, subprocess.CalledProcessError) and cause.returncode < 0:
        return True
    text = str(e)
    return any(s in text for s in ("interrupted by user", "signal terminated program",
                                   "virtual memory exhausted", "out of memory",
                                   "Cannot allocate memory"))


class _Unavailable(Exception):
    pass


_FIX = ("attnkit falls back to its Python CPU path; set ATTNKIT_NATIVE=0 to skip the "
        "native kernel and silence this warning")


# ---- switches read from the environment at every call, cheaply (the hot path reads two;
# here, not in a module of the package, because the loader also runs alone: see tests)
_ENVIRON = os.environ
_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None
_PARSED: dict[tuple[str, bytes | str | None, bool], bool] = {}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "off", "no")


def switch(name: str, default: bool) -> bool:
    """The boolean switch ``name`` (1/true/yes/on, 0/false/off/no, any case; unset or
    anything else → ``default``), read now, cheaply: the hot path reads two per call.

    ``os.environ.get`` of an unset name costs ~3 µs (a ``KeyError`` inside ``Mapping.get``); a
    small decode call reads ``ATTNKIT_NATIVE`` and ``TRITON_INTERPRET`` each time, since tests
    and users flip them at run time. On POSIX :func:`switch` looks the name up in
    ``os.environ``'s own dict (the one ``os.environ[...] =``, ``putenv`` through it and
    ``monkeypatch.setenv`` write) in ~0.1 µs and caches the parse per raw value; elsewhere, or
    when ``os.environ`` has been replaced, it asks ``os.environ.get``.
    """
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


def hot_state() -> tuple[object, object, object]:
    """What the eager hot path's remembered backend choice depends on here, read in one call:
    the raw values of ``ATTNKIT_NATIVE`` and ``TRITON_INTERPRET`` (None when unset) and the
    library loaded so far (None before the first :func:`load` and after :func:`reset` with
    ``forget_loaded``). Two equal answers mean :func:`load` and both switches answer alike."""
    env = os.environ
    if env is _ENVIRON and _DATA is not None:
        return _DATA.get(b"ATTNKIT_NATIVE"), _DATA.get(b"TRITON_INTERPRET"), _state["ops"]
    return env.get("ATTNKIT_NATIVE"), env.get("TRITON_INTERPRET"), _state["ops"]


def _switched_off() -> bool:
    """Whether ``ATTNKIT_NATIVE`` turns the kernel off (0/false/off/no), read at every call
    in ~0.1 µs (:func:`switch`)."""
    return not switch("ATTNKIT_NATIVE", True)


def load() -> object | None:
    """``torch.ops.attnkit_native`` (building it on first use), or ``None`` (see :func:`reason`)."""
    if _switched_off():
        return None
    if _state["tried"]:                            # decided: no lock, no work (hot path)
        return _state["ops"]
    with _lock:
        if not _state["tried"]:
            try:
                why = _unsupported_platform()
                if why:
                    raise _Unavailable(why)
                _state["ops"] = _build()
            except _Unavailable as e:
                _state["reason"] = str(e)
            except Exception as e:  # noqa: BLE001 — never worse than the Python path
                _state["reason"] = f"loading the native kernel failed ({type(e).__name__}: {e})"
            except BaseException:   # Ctrl-C, SystemExit: the caller's; the next call retries
                _state["tried"] = False
                raise
            _state["tried"] = True          # last: the lock-free read above sees a decision
            if _state["reason"] and not _state["warned"]:
                _state["warned"] = True
                warnings.warn(f"attnkit native CPU kernel unavailable: {_state['reason']}. "
                              f"{_FIX}.", NativeUnavailableWarning, stacklevel=3)
        return _state["ops"]


def loaded_level() -> str | None:
    """The vector level (:func:`cpu_flags`) of the build this process loaded, or None."""
    return _state.get("loaded_level")  # type: ignore[return-value]


def reason() -> str | None:
    """Why :func:`load` returns ``None`` (``None`` when the kernel is available)."""
    if _switched_off():
        return "disabled by ATTNKIT_NATIVE=0 (unset it to use the native kernel)"
    load()
    return _state["reason"]  # type: ignore[return-value]


def reset(*, forget_loaded: bool = False) -> None:
    """Forget the last attempt (tests; after installing a compiler). A loaded library stays
    loaded in the process; ``forget_loaded`` makes the next :func:`load` try again anyway."""
    with _lock:
        keep = _state["ops"] is not None and not forget_loaded
        _state.update(tried=keep, reason=None, warned=False)
        if not keep:
            _state["ops"] = None
