"""attnkit.eager: the eager path that attnkit.attention (api) and the custom operator's
implementation (ops) share — and the one-way imports it makes possible."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import torch

import attnkit as ak
from attnkit import eager

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "attnkit"


def _imported_modules(path: pathlib.Path) -> set[str]:
    """Sibling modules of the package that ``path`` imports (relative imports, any depth
    of the file: top level, inside functions, under TYPE_CHECKING)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out.update(a.name for a in node.names)
    return out


def test_imports_flow_one_way_api_to_ops_to_eager() -> None:
    assert "api" not in _imported_modules(SRC / "ops.py")
    assert not {"api", "ops"} & _imported_modules(SRC / "eager.py")
    assert {"eager", "ops"} <= _imported_modules(SRC / "api.py")


def test_each_module_imports_on_its_own() -> None:
    for mod in ("attnkit.eager", "attnkit.ops"):
        done = subprocess.run([sys.executable, "-c", f"import {mod}"], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr


def test_attention_is_the_eager_path_outside_a_graph() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, n, 8, generator=g, dtype=torch.float64) for n in (5, 7, 7))
    m = ak.masks.sliding_window(3, align="bottom_right")
    got, lse = eager.attend(q, k, v, mask=m, return_lse=True)
    want, want_lse = ak.attention(q, k, v, mask=m, return_lse=True)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)
    assert ak.api.prepare is eager.prepare and ak.api.Prepared is eager.Prepared
