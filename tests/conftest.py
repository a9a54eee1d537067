"""Fixtures and collection hooks for the test suite (helpers live in ``tests/helpers``;
nothing imports this module).

- ``backend`` (fixture, parametrised at collection time over ``attnkit.backends.names()``):
  every backend that registers itself gets the reference-comparison tests automatically.
  In the reference-comparison modules (``MODE_MODULES``) the engines with a native kernel
  appear twice: ``tiled`` / ``decode`` run on the native kernel only — a call the kernel
  cannot take (float64, a Python score_mod, ...) skips the test with the kernel's reasons,
  so nothing runs twice on the Python engine — and ``tiled[python]`` / ``decode[python]``
  run with ``ATTNKIT_NATIVE=0`` (the Python engines, every call). Elsewhere ``tiled`` and
  ``decode`` are what users get: native where it can run, the Python engine otherwise.
- ``fresh_compile``: a hermetic ``torch.compile`` (modules that compile use it);
  ``docs_site``: the documentation site, built strict once per run.
- ``lowp_path`` (params gemm / emulated / widen): the native kernel's low-precision path
  for the test (``ATTNKIT_NATIVE_LOWP_GEMM``; gemm skipped on a CPU without brgemm for the
  test's ``dtype``), for the forward's and the backward's lowp tests.
- autouse: ``_seed`` (``torch.manual_seed(0)``) and ``_engine_mode`` (the modes above).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import attnkit as ak
from helpers.tolerance import install_assert_close_log

# Keep runs deterministic and within the 2-core budget.
torch.set_num_threads(min(2, os.cpu_count() or 1))

BACKENDS: list[str] = list(ak.backends.names())
# engine → the id of its Python-engine mode (see the module docstring)
PYTHON_MODES = {"tiled": "tiled[python]", "decode": "decode[python]"}
MODE_MODULES = ("test_api.py", "test_properties.py", "test_course_examples.py",
                "test_api_reliability.py", "masks/test_flash.py")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "native_engine: tiled/decode on the native kernel only")
    config.addinivalue_line("markers", "python_engine: tiled/decode with ATTNKIT_NATIVE=0")


def backend_params(names: list[str]) -> list[Any]:
    """``names`` with each engine of ``PYTHON_MODES`` as two modes: native, then Python."""
    out: list[Any] = []
    for n in names:
        if n in PYTHON_MODES:
            out.append(pytest.param(n, id=n, marks=pytest.mark.native_engine))
            out.append(pytest.param(n, id=PYTHON_MODES[n], marks=pytest.mark.python_engine))
        else:
            out.append(n)
    return out


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test taking ``backend`` runs once per registered backend (unless the test
    parametrises ``backend`` itself)."""
    own = any("backend" in str(m.args[0]).replace(" ", "").split(",")
              for m in metafunc.definition.iter_markers("parametrize") if m.args)
    if "backend" in metafunc.fixturenames and not own:
        path = metafunc.definition.path.as_posix()
        modes = any(path.endswith("tests/" + f) for f in MODE_MODULES)
        metafunc.parametrize("backend", backend_params(BACKENDS) if modes else BACKENDS)


@pytest.fixture(autouse=True)
def _engine_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Put ``tiled``/``decode`` in the mode the test's parameter names (module docstring)."""
    if request.node.get_closest_marker("python_engine"):
        monkeypatch.setenv("ATTNKIT_NATIVE", "0")
    elif request.node.get_closest_marker("native_engine"):
        from attnkit.backends import decode, native, tiled

        if not native.available():
            pytest.skip(f"native kernel unavailable: {native.why_unavailable()}")

        def python_engine(p: Any) -> Any:
            pytest.skip("the native kernel cannot run this call (the [python] mode runs it): "
                        + "; ".join(tiled.native_reasons(p)))

        monkeypatch.setattr(tiled, "python_attention", python_engine)
        monkeypatch.setattr(decode, "_decode", python_engine)


if os.environ.get("ATTNKIT_TOLERANCE_LOG"):
    install_assert_close_log()        # every assert_close logs its margin too (helpers.tolerance)


@pytest.fixture
def fresh_compile() -> Any:
    """A hermetic ``torch.compile``: Dynamo reset before and after, and no compiled artefact
    from another run of this machine reused (a cached backward graph may hold an older
    operator schema). Modules that compile take it with
    ``pytestmark = pytest.mark.usefixtures("fresh_compile")``."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        yield
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def docs_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The documentation site, built strict once for the run: `make test` has just built it
    into build/site (it says so with ATTNKIT_DOCS_BUILT=1); otherwise it is built here."""
    root = Path(__file__).resolve().parents[1]
    if os.environ.get("ATTNKIT_DOCS_BUILT") == "1" and (root / "build" / "site").is_dir():
        return root / "build" / "site"
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("MkDocs not installed")
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                        "--site-dir", str(out)], cwd=root, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    return out


@pytest.fixture(params=["gemm", "emulated", "widen"])
def lowp_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test runs on the low-precision GEMM path (brgemm, where this CPU has it; else
    skipped), on the same path with emulated GEMMs (any CPU), and on the widening path."""
    from helpers.native_checks import use_lowp_path

    return use_lowp_path(request, monkeypatch)
