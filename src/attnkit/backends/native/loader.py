"""Build-on-first-use loader for attnkit's native CPU kernel (``attention.cpp``).

The C++ source is compiled once, through ``torch.utils.cpp_extension.load`` (ninja + the
system C++ compiler), into the user's cache directory::

    $ATTNKIT_CACHE_DIR  or  $XDG_CACHE_HOME/attnkit  or  ~/.cache/attnkit
        native/<key>/          key = hash(torch version, Python, source, CPU flags, compiler)

so a new torch, an edited source or another CPU gets its own build, and every later process
loads the cached library in milliseconds. The vector flags come from the CPU
(``/proc/cpuinfo``): AVX-512 where present, else AVX2 + FMA, else a portable build.

Anything that stops the kernel — ``ATTNKIT_NATIVE=0``, no compiler, no ninja, a failed build,
an unsupported platform — leaves :func:`load` returning ``None`` and :func:`reason` saying why
and how to fix it; one warning is issued per process (none for ``ATTNKIT_NATIVE=0``, which
is a choice, not a problem).

Caution
-------
- The first build takes about 15 s of one core (``attention.cpp`` is one translation unit
  that includes only ATen's core headers, ``ATen/native/CPUBlas.h`` and ``torch/library.h``).
  It prints one line when it starts and one with the time it took, on stderr.
- Builds of concurrent processes are serialised by torch's lock file in the build folder.
- Threads come from torch's intra-op pool (``at::parallel_for``), which needs OpenMP in the
  extension's own build: on Linux it is built with ``-fopenmp``; elsewhere it runs on one
  thread.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

__all__ = ["load", "reason", "reset", "cpu_flags", "cache_dir", "compiler", "build_key",
           "SOURCES"]

SOURCES: list[Path] = [Path(__file__).with_name("attention.cpp")]
_OPT_FLAGS = ["-O3", "-fno-math-errno"]
# at::parallel_for is an inline template: without OpenMP in *this* build it runs serially.
# (The library then uses the libgomp.so.1 torch has already loaded.)
_OMP_FLAGS = ["-fopenmp"] if sys.platform.startswith("linux") else []
_lock = threading.Lock()
_state: dict[str, object] = {"tried": False, "ops": None, "reason": None, "warned": False,
                             "loaded_key": None}


class NativeUnavailableWarning(UserWarning):
    """The native kernel could not be used; attnkit runs its Python path instead."""


def cpu_flags() -> tuple[str, list[str]]:
    """``(level, compiler flags)`` for this CPU: ``avx512``, ``avx2`` or ``portable``."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return "portable", []
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        return "portable", []
    avx2 = {"avx2", "fma", "f16c"}
    if avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "avx512", ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw",
                          "-mavx512vl", "-mavx512dq"]
    if avx2 <= flags:
        return "avx2", ["-mavx2", "-mfma", "-mf16c"]
    return "portable", []


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


def _unsupported_platform() -> str | None:
    if sys.platform == "win32":
        return ("the native kernel uses GCC/Clang vector extensions, which MSVC lacks "
                "(Windows is not supported yet)")
    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        return f"CPU architecture {platform.machine()!r} is not supported (x86-64 or ARM64)"
    return None


def _ensure_ninja() -> str | None:
    """Put PyPI ninja's binary on PATH when it is installed but not on PATH."""
    if shutil.which("ninja"):
        return None
    try:
        import ninja  # type: ignore[import-not-found]

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        return "ninja is not installed: `pip install ninja` (needed to build the native kernel)"
    return None if shutil.which("ninja") else "ninja is installed but cannot be run"


def _build() -> object:
    """Compile (or load the cached build of) attention.cpp; returns torch.ops.attnkit_native."""
    from torch.utils import cpp_extension

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
    missing = _ensure_ninja()
    if missing:
        raise _Unavailable(missing)
    key = build_key(flags, compiler)
    if _state.get("loaded_key") is not None:
        # One library per process: a second TORCH_LIBRARY("attnkit_native") would abort.
        # A build that changed since (new source, flags) takes effect in a new process.
        return torch.ops.attnkit_native
    folder = cache_dir() / "native" / key
    folder.mkdir(parents=True, exist_ok=True)
    name = f"attnkit_native_{key}"
    first = not (folder / f"{name}.so").exists()
    if first:
        print(f"attnkit: compiling the native CPU kernel ({level}) into {folder} "
              "(first use only, ~15 s)...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    env_cxx = os.environ.get("CXX")
    os.environ["CXX"] = compiler
    try:
        cpp_extension.load(name=name, sources=[str(s) for s in SOURCES],
                           extra_cflags=[*_OPT_FLAGS, *_OMP_FLAGS, *flags],
                           extra_ldflags=list(_OMP_FLAGS),  # (torch appends to these lists)
                           build_directory=str(folder),
                           is_python_module=False, verbose=False)
    except Exception as e:  # noqa: BLE001 — any build failure means "unavailable"
        tail = " | ".join(str(e).strip().splitlines()[-4:])[-600:]
        raise _Unavailable(f"the native kernel failed to build ({tail}); the build files are "
                           f"in {folder}") from e
    finally:
        if env_cxx is None:
            os.environ.pop("CXX", None)
        else:
            os.environ["CXX"] = env_cxx
    _state["loaded_key"] = key
    if first:
        print(f"attnkit: native CPU kernel built in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)
    return torch.ops.attnkit_native


class _Unavailable(Exception):
    pass


_FIX = ("attnkit falls back to its Python CPU path; set ATTNKIT_NATIVE=0 to skip the "
        "native kernel and silence this warning")


def load() -> object | None:
    """``torch.ops.attnkit_native`` (building it on first use), or ``None`` (see :func:`reason`)."""
    if os.environ.get("ATTNKIT_NATIVE", "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    with _lock:
        if not _state["tried"]:
            _state["tried"] = True
            try:
                why = _unsupported_platform()
                if why:
                    raise _Unavailable(why)
                _state["ops"] = _build()
            except _Unavailable as e:
                _state["reason"] = str(e)
            except Exception as e:  # noqa: BLE001 — never worse than the Python path
                _state["reason"] = f"loading the native kernel failed ({type(e).__name__}: {e})"
            if _state["reason"] and not _state["warned"]:
                _state["warned"] = True
                warnings.warn(f"attnkit native CPU kernel unavailable: {_state['reason']}. "
                              f"{_FIX}.", NativeUnavailableWarning, stacklevel=3)
        return _state["ops"]


def reason() -> str | None:
    """Why :func:`load` returns ``None`` (``None`` when the kernel is available)."""
    if os.environ.get("ATTNKIT_NATIVE", "1").strip().lower() in ("0", "false", "off", "no"):
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
