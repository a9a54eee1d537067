"""attnkit._compat: each private torch / transformers API attnkit uses, checked against the
installed versions (schema and behaviour), and reached from that module only."""

from __future__ import annotations

import math
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from attnkit import _compat

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "attnkit"

# What must not be spelled anywhere in src/attnkit but _compat.py.
PRIVATE = ["_scaled_dot_product_flash_attention_for_cpu", "_pytree", "DisableTorchFunction",
           "_global_mapping", "_ForceDispatchKeyGuard", "_dispatch_tls_local",
           "_disable_dynamo", "compiler.disable", "_is_compiling_flag", "_get_tracing_state"]


def test_private_apis_are_reached_from_compat_only():
    offenders = []
    for path in SRC.rglob("*.py"):
        if path.name == "_compat.py":
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            offenders += [f"{path.relative_to(SRC)}:{n}: {name}" for name in PRIVATE
                          if name in code and not re.search(r"``[^`]*" + name, code)]
    assert not offenders, "private APIs outside attnkit/_compat.py:\n" + "\n".join(offenders)


def _schema_args(op) -> list[str]:
    return [a.name for a in op.default._schema.arguments]


def test_flash_cpu_schema_is_the_one_the_engines_call():
    assert _schema_args(_compat.flash_cpu) == [
        "query", "key", "value", "dropout_p", "is_causal", "attn_mask", "scale"]
    assert [r.name for r in _compat.flash_cpu.default._schema.returns] == ["output", "logsumexp"]
    assert _schema_args(_compat.flash_cpu_backward) == [
        "grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal",
        "attn_mask", "scale"]


def test_flash_cpu_returns_the_lse_and_its_backward_the_gradients():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64) for n in (5, 7, 7))
    q, k, v = (t.float() for t in (q, k, v))
    scale = 1 / math.sqrt(8)
    s = (q.double() @ k.double().transpose(-1, -2)) * scale          # (1, 2, 5, 7)
    ref = torch.softmax(s, -1) @ v.double()
    out, lse = _compat.flash_cpu(q, k, v, 0.0, False, scale=scale)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), atol=1e-5, rtol=1e-5)
    do = torch.randn(out.shape, generator=g)
    gq, gk, gv = _compat.flash_cpu_backward(do, q, k, v, out, lse, 0.0, False, scale=scale)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    r = torch.softmax((qd @ kd.transpose(-1, -2)) * scale, -1) @ vd
    eq, ek, ev = torch.autograd.grad(r, (qd, kd, vd), do.double())
    for got, want in ((gq, eq), (gk, ek), (gv, ev)):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def test_tree_flatten_and_leaves():
    tree = ((1, [2, {"a": 3}]), {"b": torch.tensor(4.0)})
    leaves, spec = _compat.tree_flatten(tree)
    assert leaves[:3] == [1, 2, 3] and isinstance(leaves[3], torch.Tensor)
    assert _compat.tree_leaves(tree)[:3] == [1, 2, 3]
    assert spec.num_leaves == 4


def test_torch_function_disabled_hides_calls_from_a_mode():
    seen = []

    class Record(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    x = torch.ones(3)
    with Record():
        x.sum()
        n = len(seen)
        with _compat.torch_function_disabled():
            x.prod()
    assert n >= 1 and len(seen) == n


def test_hf_builtin_attention_names():
    pytest.importorskip("transformers")
    names = _compat.hf_builtin_attention_names()       # the live mapping: ours once registered
    assert {"sdpa", "eager"} <= names
    from attnkit.integrations import transformers as integration

    builtin = integration._BUILTIN_NAMES                  # taken before attnkit registers
    assert {"sdpa", "eager"} <= builtin and "attnkit" not in builtin


def test_compiling_answers_as_is_compiling(monkeypatch):
    """_compat.compiling gives torch.compiler.is_compiling()'s answer: False eagerly, True
    with the flag torch.export / a compile session set, True while Dynamo traces."""
    assert _compat.compiling() is False and torch.compiler.is_compiling() is False
    seen = []

    def f(x):
        seen.append(_compat.compiling())
        return x + 1

    torch.compiler.reset()
    torch.compile(f, backend="eager", fullgraph=True)(torch.ones(2))
    torch.compiler.reset()
    assert seen == [True]
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True, raising=False)
    assert _compat.compiling() is True and torch.compiler.is_compiling() is True


def test_jit_tracing_state_is_none_unless_a_trace_records():
    seen = []

    def f(x):
        seen.append(_compat.jit_tracing_state() is not None)
        return x * 2

    assert _compat.jit_tracing_state() is None
    torch.jit.trace(f, torch.ones(2), check_trace=False)
    assert seen == [True] and _compat.jit_tracing_state() is None


def test_run_outside_graph_breaks_the_graph_and_runs_eagerly():
    seen = []

    @_compat.run_outside_graph
    def outside(x):
        seen.append(torch.compiler.is_compiling())     # False: not traced
        return x * 2

    def f(x):
        return outside(x + 1) - 1

    x = torch.arange(4.0)
    torch.compiler.reset()
    assert torch.equal(torch.compile(f, backend="eager")(x), f(x))
    assert seen == [False, False]
    torch.compiler.reset()
    with pytest.raises(Exception, match="(?i)skip|disable|graph break"):
        torch.compile(f, backend="eager", fullgraph=True)(x)


def test_eager_calls_import_neither_dynamo_nor_sympy():
    # Dynamo's import is most of ``import attnkit``'s time, sympy's (through
    # torch.broadcast_shapes) most of a first score_mod call's; only compiling needs them.
    code = ("import sys, torch, attnkit as ak; q = torch.randn(1, 2, 5, 8); "
            "ak.attention(q, q, q, mask=ak.masks.causal() & ak.masks.from_fn("
            "lambda b, h, i, j: i >= j - 2)); "
            "ak.attention(q, q, q, score_mod=lambda s, b, h, i, j: s - (i - j).abs()); "
            "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
