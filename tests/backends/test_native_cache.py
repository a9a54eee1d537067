"""The native build cache under damage, kills and odd file systems (loader.py, score_mod.py).

Each case runs in a fresh process with a private ``ATTNKIT_CACHE_DIR`` (a truncated library
kills the process that maps it, and a process loads one native library at most), bounded by a
timeout. Most cases build a tiny stand-in for ``attention.cpp`` (one C function: the loader's
build, lock, checksum and publishing are the same, in a fraction of a second), with the
loader alone in the child (a quicker start); the score_mod case runs ``ak.attention`` on the
real kernel, copied from this process's cache with its key pinned (no rebuild).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from attnkit.backends import native
from attnkit.backends.native import loader, score_mod

pytestmark = pytest.mark.skipif(
    sys.platform == "win32" or loader.compiler() is None or loader._unsupported_platform()
    is not None or loader._find_ninja()[0] is not None,
    reason="needs a C++ compiler and ninja on a platform the native kernel builds on")

TINY = 'extern "C" int attnkit_tiny_build(void) { return 42; }\n'

# Run in every child. argv: the tiny source (or "": the real kernel), the real kernel's key
# to pin (or ""), loader.py's path when the child needs the loader only (or ""). A child
# prints one JSON line last.
PRELUDE = """
import json, os, sys, warnings
from pathlib import Path
warnings.simplefilter("always")
if sys.argv[3]:                  # the loader alone (it needs torch only): a quicker start
    import importlib.util
    spec = importlib.util.spec_from_file_location("attnkit_native_loader", sys.argv[3])
    loader = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = loader
    spec.loader.exec_module(loader)
else:
    from attnkit.backends.native import loader
if sys.argv[1]:
    loader.SOURCES = [Path(sys.argv[1])]
if len(sys.argv) > 2 and sys.argv[2]:                 # the real kernel, pinned to its key
    loader.build_key = lambda flags, compiler: sys.argv[2]

def so_path():
    level, flags = loader.cpu_flags()
    key = loader.build_key(flags, loader.compiler())
    name = f"attnkit_native_{key}"
    return loader.cache_dir() / "native" / key / f"{name}.so"

def report(**kw):
    print(json.dumps(kw), flush=True)
"""


def _start(code: str, cache: Path, *, source: Path | str = "", key: str = "",
           env: dict[str, str] | None = None) -> subprocess.Popen:
    """``code`` after PRELUDE in a new process (and session, so that whatever it leaves
    running can be killed with it), with ``cache`` as ATTNKIT_CACHE_DIR; the loader alone
    when the child builds a tiny ``source``."""
    full = {**os.environ, "ATTNKIT_CACHE_DIR": str(cache), **(env or {})}
    full.pop("ATTNKIT_NATIVE", None)
    alone = loader.__file__ if source else ""
    return subprocess.Popen([sys.executable, "-c", PRELUDE + code, str(source), key, alone],
                            env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _child(code: str, cache: Path, *, source: Path | str = "", key: str = "",
           env: dict[str, str] | None = None, timeout: float = 120,
           ) -> subprocess.CompletedProcess:
    """Run :func:`_start`'s child to its end (at most ``timeout`` s: a hang fails the test)."""
    p = _start(code, cache, source=source, key=key, env=env)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(p)
        out, err = p.communicate()
        pytest.fail(f"the child hung (> {timeout} s); stderr:\n{err[-3000:]}")
    finally:
        _kill_group(p)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _kill_group(p: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)


def _last_json(run: subprocess.CompletedProcess) -> dict:
    assert run.returncode == 0, (f"exit {run.returncode} (-7/135: SIGBUS)\n"
                                 f"stderr:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def _so_of(cache: Path, source: Path | None, compiler: str | None = None) -> Path:
    """Where the loader puts the library of ``source`` (None: the real kernel)."""
    saved = loader.SOURCES
    try:
        if source is not None:
            loader.SOURCES = [source]
        _, flags = loader.cpu_flags()
        key = loader.build_key(flags, compiler or loader.compiler())
    finally:
        loader.SOURCES = saved
    return cache / "native" / key / f"attnkit_native_{key}.so"


LOAD = """
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    ops = loader.load()
report(loaded=ops is not None, reason=loader.reason(), verified=loader.verify_library(so_path())
       if hasattr(loader, "verify_library") else "n/a",
       warnings=[f"{x.category.__name__}: {x.message}" for x in w])
"""


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny source, a compiler that can be made slow (to stop a build half-way), and a
    cache holding the tiny source's verified build."""
    root = tmp_path_factory.mktemp("tiny")
    src = root / "src" / "tiny.cpp"
    src.parent.mkdir()
    src.write_text(TINY)
    slow_flag = root / "slow"
    slow = root / "bin" / "c++"                 # (named c++: torch checks the name)
    slow.parent.mkdir()
    # slow for compiling and linking only (-c, -o): torch asks the compiler its version (-v,
    # -dumpversion) before the build starts and takes its lock, and a slow answer there kept
    # the Ctrl-C test's interrupter waiting for a lock that came too late
    slow.write_text(f'#!/bin/sh\ncase " $* " in *" -c "*|*" -o "*) [ -e "{slow_flag}" ] '
                    f'&& sleep 60;; esac\nexec "{loader.compiler()}" "$@"\n')
    slow.chmod(0o755)
    cache = root / "built"
    got = _last_json(_child(LOAD, cache, source=src))
    assert got["loaded"], got
    return {"src": src, "cache": cache, "slow": slow, "slow_flag": slow_flag}


def _copy(tiny: dict[str, Path], to: Path) -> Path:
    shutil.copytree(tiny["cache"], to)
    return to


# ---------------------------------------------------------------------------- 1: damage
def test_truncated_library_is_rebuilt_with_one_warning(tiny, tmp_path) -> None:  # noqa: ANN001
    """A cached library cut short (a full disk, a killed copy) used to be mapped anyway and
    kill the process with SIGBUS; now its size and checksum don't match what was written
    after the build, so it is rebuilt (one RuntimeWarning) and loads."""
    cache = _copy(tiny, tmp_path / "cache")
    so = _so_of(cache, tiny["src"])
    size = so.stat().st_size
    os.truncate(so, size // 3)
    got = _last_json(_child(LOAD, cache, source=tiny["src"]))
    assert got["loaded"] and got["reason"] is None and got["verified"] is None, got
    assert len(got["warnings"]) == 1, got["warnings"]
    assert "RuntimeWarning" in got["warnings"][0] and "damaged" in got["warnings"][0]
    assert so.stat().st_size == size and loader.verify_library(so) is None


_SCORE_MOD = """
import torch, attnkit as ak
from attnkit.backends.native import score_mod
def mod(score, b, h, q_idx, kv_idx):
    return score + (q_idx - kv_idx) * 0.0421875
torch.manual_seed(0)
q = torch.randn(1, 2, 40, 16)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    out = ak.attention(q, q, q, score_mod=mod)
ref = ak.attention(q, q, q, score_mod=mod, backend="reference")
st = score_mod.stats()
report(err=(out - ref).abs().max().item(), builds=st["builds"], loads=st["loads"],
       failed=st["failed"], warnings=[f"{x.category.__name__}: {x.message}" for x in w])
"""


def _copy_of_the_kernel_cache(tmp_path: Path) -> tuple[str, Path]:
    """This CPU's built kernel copied into a fresh cache under ``tmp_path`` (no locks, no
    half-built or failed markers): its build key and the cache's root."""
    level, flags = loader.cpu_flags()
    key = loader.build_key(flags, loader.compiler())
    cache = tmp_path / "cache"
    shutil.copytree(loader.cache_dir() / "native" / key, cache / "native" / key,
                    ignore=shutil.ignore_patterns("*.lock", "lock", "*.build-*", "failed"))
    return key, cache


def test_truncated_score_mod_library_is_rebuilt(tmp_path) -> None:  # noqa: ANN001
    """The same for a compiled score_mod (``score_mod/mod_<key>.so``, loaded with ctypes)."""
    if not native.available():
        pytest.skip(f"native kernel unavailable here: {native.why_unavailable()}")
    key, cache = _copy_of_the_kernel_cache(tmp_path)
    first = _last_json(_child(_SCORE_MOD, cache, key=key))
    assert first["builds"] == 1 and first["loads"] == 1 and first["err"] < 1e-5, first
    (mod,) = (cache / "score_mod").glob("mod_*.so")
    os.truncate(mod, 4000)
    got = _last_json(_child(_SCORE_MOD, cache, key=key))
    assert got["builds"] == 1 and got["loads"] == 1 and not got["failed"], got
    assert got["err"] < 1e-5
    damaged = [m for m in got["warnings"] if "damaged" in m]
    assert len(damaged) == 1 and "RuntimeWarning" in damaged[0], got["warnings"]
    assert loader.verify_library(mod) is None


_LOADED = """
ops = loader.load()
report(loaded=ops is not None, reason=loader.reason(),
       cpp_extension="torch.utils.cpp_extension" in sys.modules,
       setuptools="setuptools" in sys.modules)
"""


def test_loading_the_cached_kernel_imports_no_extension_builder() -> None:
    """``torch.utils.cpp_extension`` imports setuptools (~0.2 s of every fresh process's
    first native call); a verified cached kernel loads without it."""
    if not native.available():
        pytest.skip(f"native kernel unavailable here: {native.why_unavailable()}")
    level, flags = loader.cpu_flags()
    key = loader.build_key(flags, loader.compiler())
    got = _last_json(_child(_LOADED, loader.cache_dir(), key=key))
    assert got["loaded"] and got["reason"] is None, got
    assert not got["cpp_extension"] and not got["setuptools"], got


def test_two_processes_building_one_score_mod_at_once(tmp_path) -> None:  # noqa: ANN001
    """Two fresh processes call the same new score_mod at the same moment (a compiler slowed
    by 1.5 s, so that one usually still holds the library's lock when the other arrives): one
    builds it, the other loads that build; both are right, one verified library is left."""
    if not native.available():
        pytest.skip(f"native kernel unavailable here: {native.why_unavailable()}")
    key, cache = _copy_of_the_kernel_cache(tmp_path)
    slow = tmp_path / "slow-c++"
    slow.write_text(f"#!/bin/sh\nsleep 1.5\nexec {loader.compiler()} \"$@\"\n")
    slow.chmod(0o755)
    procs = [_start(_SCORE_MOD, cache, key=key, env={"CXX": str(slow)}) for _ in range(2)]
    runs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=180)
        finally:
            _kill_group(p)
        runs.append(_last_json(subprocess.CompletedProcess(p.args, p.returncode, out, err)))
    assert sum(r["builds"] for r in runs) == 1, runs
    assert all(r["err"] < 1e-5 and not r["failed"] and not r["warnings"] for r in runs), runs
    (mod,) = (cache / "score_mod").glob("mod_*.so")
    assert loader.verify_library(mod) is None
    assert not list((cache / "score_mod").glob("*.build-*"))


def test_verify_library_names_what_is_wrong(tmp_path) -> None:  # noqa: ANN001
    so = tmp_path / "lib.so"
    assert loader.verify_library(so) == "missing"
    so.write_bytes(b"\x7fELF" + bytes(1000))
    assert "unverified" in loader.verify_library(so)

    def build(staging: Path) -> Path:
        (staging / "x.so").write_bytes(b"\x7fELF" + bytes(2000))
        return staging / "x.so"

    assert loader.cached_library(so, build, what="a test library")    # built, published
    assert loader.verify_library(so) is None and so.stat().st_size == 2004
    assert not loader.cached_library(so, build, what="a test library")  # verified: kept
    os.truncate(so, 100)
    assert "100 bytes where 2004" in loader.verify_library(so)
    so.write_bytes(b"\x7fELF" + bytes(1999) + b"!")
    assert "SHA-256" in loader.verify_library(so)
    assert not list(tmp_path.glob("*.build-*")), "the staging folder is removed"


# ---------------------------------------------------------------------------- 2: locks
_STOPPED = """
print("started", flush=True)
ops = loader.load()
report(loaded=ops is not None)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_killed_first_build_does_not_block_the_next(tiny, tmp_path, sig) -> None:  # noqa: ANN001
    """A first build stopped by SIGTERM / SIGKILL (here: while its compiler runs) left torch's
    lock file, and every later process waited for it forever. The next process now takes the
    build over at once (the flock died with its holder) and builds."""
    cache = tmp_path / "cache"
    env = {"CXX": str(tiny["slow"])}
    tiny["slow_flag"].touch()
    try:
        p = _start(_STOPPED, cache, source=tiny["src"], env=env)
        try:
            t0 = time.monotonic()                      # wait until its compiler runs
            while not (list(cache.glob("native/*/*.build-*/lock"))    # torch's, while it
                       or list(cache.glob("native/*/lock"))):  # builds (before the fix: here)
                assert p.poll() is None and time.monotonic() - t0 < 60, p.communicate()
                time.sleep(0.1)
            time.sleep(0.5)
            p.send_signal(sig)                         # the Python process only, as timeout(1)
            p.wait(timeout=30)
        finally:
            _kill_group(p)                             # (and its orphaned compiler)
            p.communicate()
        assert p.returncode == -sig
    finally:
        tiny["slow_flag"].unlink()
    t0 = time.monotonic()
    run = _child(LOAD, cache, source=tiny["src"], env=env, timeout=60)
    got = _last_json(run)
    assert got["loaded"] and got["verified"] is None and not got["warnings"], got
    assert "compiling" in run.stderr and "waiting" not in run.stderr
    assert time.monotonic() - t0 < 45
    key_dir = _so_of(cache, tiny["src"], str(tiny["slow"])).parent
    assert not list(key_dir.glob("*.build-*")), "the killed build's staging folder is cleared"


def test_a_live_holder_is_waited_for_with_a_bound_and_a_message(tiny, tmp_path) -> None:  # noqa: ANN001
    """While another (live) process holds the build lock, a process says what it waits for
    (the lock's path and the holder's pid) and, past the bound, falls back with one warning."""
    import fcntl

    cache = _copy(tiny, tmp_path / "cache")
    so = _so_of(cache, tiny["src"])
    so.unlink()                                      # needs a build, which another one holds
    lock = so.with_name(so.stem + ".lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        run = _child("loader._WAIT_S, loader._SAY_S = 3.0, 0.5\n" + LOAD, cache,
                     source=tiny["src"], timeout=60)
    finally:
        os.close(fd)
    got = _last_json(run)
    assert not got["loaded"], got
    assert f"pid {os.getpid()}" in run.stderr and str(lock) in run.stderr, run.stderr
    assert "waiting" in run.stderr and "compiling" not in run.stderr
    assert len(got["warnings"]) == 1 and "gave up after 3 s" in got["warnings"][0], got
    # released: the next process builds
    got = _last_json(_child(LOAD, cache, source=tiny["src"]))
    assert got["loaded"] and got["verified"] is None, got


# ---------------------------------------------------------------------------- read-only
_READ_ONLY = """
import builtins, errno, io, os
ROOT = os.path.realpath(os.environ["ATTNKIT_CACHE_DIR"])

def _inside(path):
    try:
        return os.path.realpath(os.fspath(path)).startswith(ROOT)
    except TypeError:
        return False

def _erofs(path):
    raise OSError(errno.EROFS, "Read-only file system (simulated)", os.fspath(path))

def _guard(fn, check):
    def wrapped(path, *a, **k):
        if _inside(path) and check(path, *a, **k):
            _erofs(path)
        return fn(path, *a, **k)
    return wrapped

_W = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
os.open = _guard(os.open, lambda p, flags, *a, **k: flags & _W)
io.open = builtins.open = _guard(builtins.open,
                                 lambda p, mode="r", *a, **k: set(mode) & set("wxa+"))
_mkdir = os.mkdir
def _mk(path, *a, **k):
    if _inside(path):
        if os.path.exists(path):
            raise FileExistsError(errno.EEXIST, "File exists", os.fspath(path))
        _erofs(path)
    return _mkdir(path, *a, **k)
os.mkdir = _mk
for name in ("replace", "rename", "remove", "unlink", "rmdir", "truncate"):
    setattr(os, name, _guard(getattr(os, name), lambda *a, **k: True))
"""


def _read_only(path: Path, how: str) -> tuple[Path, str, Callable[[], object]]:
    """``path`` seen read-only: (where, extra child code, undo)."""
    if how == "simulated":
        return path, _READ_ONLY, lambda: None
    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("mount") is None:
        if os.geteuid() != 0:                        # permissions hold for non-root
            for d, _, files in os.walk(path):
                for f in files:
                    os.chmod(os.path.join(d, f), 0o444)
                os.chmod(d, 0o555)

            def undo() -> None:
                for d, _, _ in os.walk(path):
                    os.chmod(d, 0o755)
            return path, "", undo
        pytest.skip("root without mount(8): the simulated case covers this")
    view = path.with_name(path.name + "-ro")
    view.mkdir()
    r = subprocess.run(["mount", "--bind", str(path), str(view)], capture_output=True,
                       timeout=30)
    if r.returncode == 0:
        r = subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], capture_output=True,
                           timeout=30)
        if r.returncode != 0:
            subprocess.run(["umount", str(view)], timeout=30)
    if r.returncode != 0:
        pytest.skip(f"no read-only bind mount here ({r.stderr.decode().strip()[:200]}): "
                    "the simulated case covers this")
    probe = view / "probe"
    try:
        probe.touch()
        subprocess.run(["umount", str(view)], timeout=30)
        pytest.skip("the bind mount is not read-only here")
    except OSError as e:
        assert e.errno == errno.EROFS
    return view, "", lambda: subprocess.run(["umount", str(view)], timeout=30)


@pytest.mark.parametrize("state", ["verified", "damaged", "empty"])
@pytest.mark.parametrize("how", ["mounted", "simulated"])
def test_read_only_cache(tiny, tmp_path, how, state) -> None:  # noqa: ANN001
    """A read-only cache holding a verified build is used as it is (loading writes nothing);
    a damaged build or none there falls back with one warning that says why and to set
    ATTNKIT_CACHE_DIR (and never maps the damaged file)."""
    if state == "empty":
        cache = tmp_path / "cache"
        cache.mkdir()
    else:
        cache = _copy(tiny, tmp_path / "cache")
        for stale in cache.rglob("*.lock"):
            stale.unlink()
        if state == "damaged":
            so = _so_of(cache, tiny["src"])
            os.truncate(so, so.stat().st_size // 3)
    where, extra, undo = _read_only(cache, how)
    try:
        got = _last_json(_child(extra + LOAD, where, source=tiny["src"]))
    finally:
        undo()
    if state == "verified":
        assert got["loaded"] and got["reason"] is None and not got["warnings"], got
        return
    assert not got["loaded"] and "cannot be written" in got["reason"], got
    assert "ATTNKIT_CACHE_DIR" in got["reason"] and len(got["warnings"]) == 1, got
    if state == "damaged":
        assert "damaged" in got["reason"], got


# ---------------------------------------------------------------------------- failures
def test_a_failed_build_is_remembered_until_its_file_is_deleted(tiny, tmp_path) -> None:  # noqa: ANN001
    """A build that fails (a compile error here; a full disk alike) is not compiled again by
    every new process: the next one falls back at once, with one warning naming the file to
    delete; once it is deleted, the build is tried again."""
    cache = tmp_path / "cache"
    broken = tmp_path / "src" / "broken.cpp"
    broken.parent.mkdir()
    broken.write_text("this is not C++;\n")
    first = _child(LOAD, cache, source=broken)
    got = _last_json(first)
    assert not got["loaded"] and "failed to build" in got["reason"], got
    assert len(got["warnings"]) == 1 and "compiling" in first.stderr
    failed = _so_of(cache, broken).with_name("failed")
    assert failed.exists() and "failed to build" in failed.read_text()
    assert str(failed) in got["warnings"][0]

    again = _child(LOAD, cache, source=broken)
    got = _last_json(again)
    assert not got["loaded"] and "compiling" not in again.stderr, again.stderr
    assert len(got["warnings"]) == 1 and str(failed) in got["warnings"][0], got
    assert "failed to build" in got["reason"] and "earlier run" in got["reason"]

    failed.unlink()
    retry = _child(LOAD, cache, source=broken)
    assert "compiling" in retry.stderr and not _last_json(retry)["loaded"]


# ---------------------------------------------------------------------------- 8a: Ctrl-C
_INTERRUPTED = """
import signal, threading, time
from pathlib import Path
flag = Path(sys.argv[3])
def interrupt_when_compiling():
    t0 = time.monotonic()
    while not (list(loader.cache_dir().glob("native/*/*.build-*/lock"))  # torch's lock
               or list(loader.cache_dir().glob("native/*/lock"))):        # (before the fix)
        time.sleep(0.05)
        if time.monotonic() - t0 > 120:                # (a loaded machine starts slowly)
            return
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGINT)               # Ctrl-C
threading.Thread(target=interrupt_when_compiling, daemon=True).start()
try:
    loader.load()
    first = "went on"
except KeyboardInterrupt:
    first = "KeyboardInterrupt"
flag.unlink()                                         # the compiler is quick again
failed = so_path().with_name("failed")
ops = loader.load()
report(first=first, failed_file=failed.exists(), loaded=ops is not None,
       reason=loader.reason())
"""


def test_ctrl_c_during_the_first_build_reaches_the_caller_and_is_not_remembered(
        tiny, tmp_path) -> None:  # noqa: ANN001
    """Ctrl-C while the kernel compiles raises KeyboardInterrupt in the caller; the attempt
    is not remembered (in the process or on disk), so the next call builds and loads."""
    tiny["slow_flag"].touch()
    try:
        run = _child(_INTERRUPTED.replace("sys.argv[3]", repr(str(tiny["slow_flag"]))),
                     tmp_path / "cache", source=tiny["src"], env={"CXX": str(tiny["slow"])},
                     timeout=300)         # it hung past 120 s once on a 2-core box under load
    finally:
        tiny["slow_flag"].unlink(missing_ok=True)
    got = _last_json(run)
    assert got["first"] == "KeyboardInterrupt", got
    assert got["loaded"] and got["reason"] is None and not got["failed_file"], got


def test_a_score_mod_compiler_killed_by_a_signal_is_retried(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """A score_mod compile stopped by a signal (Ctrl-C, the OOM killer) is not remembered as
    failed: the next call builds it."""
    if not native.available():
        pytest.skip(f"native kernel unavailable here: {native.why_unavailable()}")
    flag = tmp_path / "kill"
    cxx = tmp_path / "bin" / "c++"
    cxx.parent.mkdir()
    cxx.write_text(f'#!/bin/sh\n[ -e "{flag}" ] && kill -9 $$\nexec "{loader.compiler()}" "$@"\n')
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path / "cache"))

    def mod(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return score - (q_idx - kv_idx) * 0.0390625

    flag.touch()
    with pytest.warns(RuntimeWarning, match="signal 9"), pytest.raises(score_mod.Unsupported):
        score_mod.compile_score_mod(mod)
    flag.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = score_mod.compile_score_mod(mod)
    assert got.address


def test_keyboard_interrupt_in_load_propagates(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    """In-process: an interrupt inside the build is the caller's, and the next load() tries
    again instead of returning None with no reason."""
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ATTNKIT_NATIVE", raising=False)   # (the suite may run with it =0)
    saved = dict(loader._state)
    calls = []

    def interrupted() -> object:
        calls.append(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(loader, "_build", interrupted)
    try:
        loader.reset(forget_loaded=True)
        with pytest.raises(KeyboardInterrupt):
            loader.load()
        with pytest.raises(KeyboardInterrupt):
            loader.load()
        assert len(calls) == 2
    finally:
        loader._state.update(saved)



def test_the_build_environment_is_given_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """CXX and PATH are set for torch's extension builder during a build only."""
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin")
    with loader._build_environment("/opt/cc/g++", "/opt/ninja/bin"):
        assert os.environ["CXX"] == "/opt/cc/g++"
        assert os.environ["PATH"] == "/opt/ninja/bin" + os.pathsep + "/usr/bin"
    assert "CXX" not in os.environ and os.environ["PATH"] == "/usr/bin"
    monkeypatch.setenv("CXX", "clang++")
    with pytest.raises(RuntimeError), loader._build_environment("g++", None):
        raise RuntimeError("a failed build")
    assert os.environ["CXX"] == "clang++" and os.environ["PATH"] == "/usr/bin"
