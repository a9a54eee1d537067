"""The backend registry: declared capabilities, the literal priority list, and the errors
that describe a call once and give every backend's reasons on a line of its own."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit import backends
from attnkit.api import prepare
from attnkit.backends.base import Capabilities


def _problem(*shape: int, **kw):  # noqa: ANN202
    b, hq, hkv, nq, nk, d = shape
    return prepare(torch.randn(b, hq, nq, d), torch.randn(b, hkv, nk, d),
                   torch.randn(b, hkv, nk, d), **kw).problem


def test_priority_is_the_literal_list():
    assert backends.PRIORITY == ["triton", "decode", "tiled", "reference"]
    assert set(backends.PRIORITY) <= set(backends.REGISTRY)


def test_a_backend_whose_module_is_missing_is_left_out(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(backends, "PRIORITY", [*backends.PRIORITY[:-1], "ghost", "reference"])
    backends._load("ghost", "GhostBackend")
    assert "ghost" not in backends.PRIORITY and "ghost" not in backends.REGISTRY


def test_builtin_backends_declare_capabilities():
    for name in ("reference", "decode", "triton"):
        assert isinstance(backends.get(name).capabilities, Capabilities), name
    assert backends.get("reference").capabilities.devices is None
    dec = backends.get("decode").capabilities
    assert (dec.devices, dec.max_queries, dec.grad, dec.dropout) == (("cpu",), 16, False, False)


def test_capabilities_turn_every_unmet_field_into_a_reason():
    caps = Capabilities(devices=("cuda",), dtypes=(torch.float16,), max_head_dim=4,
                        max_queries=2, grad=False, dropout=False, score_mod=False,
                        hints=(("grad", "train elsewhere"),))
    q = torch.randn(1, 1, 3, 8, requires_grad=True)
    p = prepare(q, q, q, dropout_p=0.5, score_mod=lambda s, b, h, i, j: s).problem
    reasons = caps.reasons(p)
    assert len(reasons) == 7, reasons
    for needle in ("CUDA only (inputs are on cpu)", "float32 is not supported", "exceed 4",
                   "N_q=3", "forward only (inputs require grad): train elsewhere",
                   "dropout_p=0.5", "score_mod"):
        assert any(needle in r for r in reasons), (needle, reasons)
    assert Capabilities(devices=None, dtypes=None).reasons(p) == []


def test_every_capability_field_is_checked():
    """Each field of Capabilities (but hints) turns into a reason above: a field that no
    check reads (as ``mask_kinds`` once was) would promise what nothing enforces."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(Capabilities)} - {"hints"}
    assert fields == {"devices", "dtypes", "max_head_dim", "max_queries", "grad", "dropout",
                      "score_mod"}


def test_no_backend_fits_describes_the_call_once_then_one_line_per_backend(
        monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(backends, "PRIORITY", ["triton", "decode"])
    q = torch.randn(2, 3, 5, 8, requires_grad=True)
    with pytest.raises(ValueError) as e:
        ak.attention(q, q, q, mask=ak.masks.causal())
    lines = str(e.value).splitlines()
    assert lines[0].startswith("no backend can run this call (")
    for needle in ("(2, 3, 5, 8)", "float32", "cpu", "mask causal"):
        assert needle in lines[0], lines[0]
    assert lines[1].startswith("  triton: ") and lines[2].startswith("  decode: forward only")
    assert len(lines) == 3 and str(e.value).count("(2, 3, 5, 8)") == 3   # q, k, v: once each


def test_forced_backend_gives_its_reasons_and_the_call():
    p = _problem(1, 2, 2, 20, 30, 8, dropout_p=0.1)
    with pytest.raises(ValueError) as e:
        backends.select(p, "decode")
    msg = str(e.value)
    assert msg.splitlines()[0].startswith("backend 'decode' cannot run this call: made for")
    assert "16 queries" in msg and "dropout_p=0.1" in msg and "the call: q (1, 2, 20, 8)" in msg
    assert "backend='auto'" in msg.splitlines()[-1]


def test_missing_triton_names_the_extra(monkeypatch: pytest.MonkeyPatch):
    """Without the triton package the reason gives the exact install command."""
    import torch

    from attnkit.api import prepare
    from attnkit.backends import triton as tb

    monkeypatch.setattr(tb, "triton_available", lambda: False)
    p = prepare(torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4)).problem
    assert any('pip install "attnkit[triton]"' in r
               for r in ak.backends.get("triton").not_supported_reasons(p))
