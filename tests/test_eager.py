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


def _drop_key_3(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
    return torch.where(kv_idx == 3, -float("inf"), score)


def test_a_backend_without_screens_kv_keeps_the_kv_screen_up_front(monkeypatch) -> None:
    """Backend.forward_screened's ``finite`` vouches for K/V only where the backend says so
    (``screens_kv``): one whose ``finite`` tells of ``out`` alone still gets the K/V screen,
    so a NaN V row a score_mod scores −∞ gives NaN where a query sees the key, as the
    reference gives."""
    from attnkit.backends import REGISTRY, base

    tiled = REGISTRY["tiled"]

    class OutOnly(base.Backend):
        name = "out_only"
        capabilities = tiled.capabilities

        def forward(self, p):  # noqa: ANN001, ANN202
            return tiled.forward(p)

        def forward_screened(self, p):  # noqa: ANN001, ANN202
            out, lse = self.forward(p)
            return out, lse, bool(torch.isfinite(out).all())     # of out only

    monkeypatch.setitem(REGISTRY, "out_only", OutOnly())
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 32) for _ in range(3))
    v[..., 3, :] = float("nan")
    with torch.no_grad():
        got = ak.attention(q, k, v, score_mod=_drop_key_3, backend="out_only")
    want = ak.attention(q.double(), k.double(), v.double(), score_mod=_drop_key_3,
                        backend="reference")
    assert torch.equal(got.isnan(), want.isnan()) and want.isnan().any()


def test_dropout_under_a_score_mod_draws_its_weights_once(monkeypatch) -> None:
    """With dropout, a non-finite K row under a score_mod is screened before the call (not
    after, which would run the call twice and draw the dropout mask twice): the rows that
    cannot see the bad key get the same output as the clean call with the same seed."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 48, 16) for _ in range(3))
    k_bad = k.clone()
    k_bad[0, 0, 3, 5] = float("inf")                  # key 3: scored −∞, seen by rows >= 3
    with torch.no_grad():
        torch.manual_seed(7)
        clean = ak.attention(q, k, v, is_causal=True, score_mod=_drop_key_3, dropout_p=0.3)
        torch.manual_seed(7)
        got = ak.attention(q, k_bad, v, is_causal=True, score_mod=_drop_key_3, dropout_p=0.3)
    assert torch.equal(got[0, 0, :3], clean[0, 0, :3])
    assert got[0, 0, 3:].isnan().all()
