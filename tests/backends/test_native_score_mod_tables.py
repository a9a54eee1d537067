"""Distance tables in a compiled score_mod (native/codegen.py ``distance_tables``).

A node that reads the positions only through ``q_idx − kv_idx`` and holds a costly function
(``sqrt``, ``log``, ...) is read from a per-thread table over the distance in the narrow
build. The table runs the same C statements, so a call must give the *same bits* as the
build without tables — forward and gradients, every dtype, rows longer than one table
lookup, distance ranges wider than a table (it starts afresh), GQA, N_q ≠ N_k — and match
the float64 reference as every compiled score_mod does.

Shape legend: q (B, H_q, N_q, D), k, v (B, H_kv, N_k, D).
"""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.backends import native
from attnkit.backends.native import codegen
from attnkit.backends.native import score_mod as sm
from attnkit.backends.tiled import counting
from helpers.tolerance import assert_low_precision_close

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernel unavailable: "
                                                               f"{native.why_unavailable()}")
SLOPE = torch.tensor([0.3, 0.2, 0.1, 0.05])


def sqrt_distance(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    return score - 0.02 * (q_idx - kv_idx).abs().to(score.dtype).sqrt()


def log_decay_per_head(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    return score - 0.05 * (h + 1) * torch.log1p((kv_idx - q_idx).abs().float())


def captured_slope_of_log(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    # the log is tabled; the captured slope is read per score (its data may change)
    return score - SLOPE[h] * torch.log1p((q_idx - kv_idx).abs().float())


def bucket_of_log(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    # an integer node tabled (a T5-like bucket), its use a float
    n = (kv_idx - q_idx).abs()
    bucket = torch.minimum((torch.log1p(n.float()) * 3).long(), torch.full_like(n, 20))
    return score + 0.1 * bucket.float() - 0.01 * q_idx.float()


def linear(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    return score + 0.01 * (q_idx - kv_idx)                  # nothing costly: no table


def chunked_log(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    # an integer division may flag a row (÷ 0): never tabled, still compiled
    return score - torch.log1p(((q_idx - kv_idx) // 16).abs().float())


def dtype_of_a_product(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201
    # the table's cast reads the dtype of a per-score value (not a table's node)
    y = score * 1.5
    return y - torch.sqrt((q_idx - kv_idx).abs().float()).to(y.dtype)


TABLED = [sqrt_distance, log_decay_per_head, captured_slope_of_log, bucket_of_log,
          dtype_of_a_product]


def _plan(fn):  # noqa: ANN001, ANN202
    gm, _ = sm._trace(fn, torch.float32)
    return codegen.distance_tables(gm)


def test_the_plan_tables_costly_distance_nodes_only():
    plan = _plan(sqrt_distance)
    assert plan is not None and [n.name for n in plan.tabled] == ["mul"]   # 0.02·√|q − kv|
    assert plan.keyed == (False, False)
    assert _plan(log_decay_per_head).keyed == (False, True)             # h inside the table
    plan = _plan(captured_slope_of_log)
    assert plan is not None and all("getitem" not in n.name for n in plan.tabled)
    assert _plan(linear) is None


def _source(fn, dtype=torch.float32):  # noqa: ANN001, ANN202
    gm, ex = sm._trace(fn, dtype)
    ng = codegen.Gen(gm, ex, True, dtype, limit=codegen.POSITION_LIMIT,
                     tables=codegen.distance_tables(gm))
    out = ng.run()
    wide = codegen.Gen(gm, ex, True, dtype)
    return codegen.source(wide, wide.run(), (ng, out), wide=False)


@pytest.mark.parametrize("fn", TABLED, ids=lambda f: f.__name__)
def test_tabled_builds_read_a_table(fn):  # noqa: ANN001
    assert "ak_fill" in _source(fn) and "ak_fill" in _source(fn, torch.float64)


def test_a_flagging_fill_is_not_tabled():
    assert _plan(chunked_log) is not None          # the analysis finds the log ...
    assert "ak_fill" not in _source(chunked_log)   # ... the fill would flag: computed per key


def _run(fn, q, k, v, **opts):  # noqa: ANN001, ANN202
    ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with counting() as n:
        out = ak.attention(*ins, score_mod=fn, **opts)
    assert n["native"] == 1, n
    torch.manual_seed(9)
    grads = torch.autograd.grad(out, ins, torch.randn_like(out))
    return out.detach(), grads


def _untabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sm, "distance_tables", lambda gm: None)
    sm.clear()


CASES = {
    "gqa awkward": dict(shape=((2, 4, 97, 24), (2, 2, 113, 24)), opts={"is_causal": True}),
    "long rows": dict(shape=((1, 2, 3, 16), (1, 2, 5000, 16)), opts={}),            # 2 chunks
    "wider than a table": dict(shape=((1, 1, 2, 8), (1, 1, 20000, 8)), opts={}),    # afresh
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("fn", TABLED + [chunked_log], ids=lambda f: f.__name__)
def test_tables_give_the_bits_of_the_build_without(fn, case, dtype,  # noqa: ANN001
                                                   monkeypatch: pytest.MonkeyPatch):
    if case == "wider than a table" and dtype == torch.float64 and fn is not sqrt_distance:
        pytest.skip("one float64 case of the widest shape is enough (slow double rows)")
    torch.manual_seed(1)
    (qs, ks), opts = CASES[case]["shape"], CASES[case]["opts"]
    q = torch.randn(qs).to(dtype)
    k, v = torch.randn(ks).to(dtype), torch.randn(ks).to(dtype)
    sm.clear()
    got, g = _run(fn, q, k, v, **opts)
    _untabled(monkeypatch)
    want, gw = _run(fn, q, k, v, **opts)
    sm.clear()
    assert torch.equal(got, want)
    for a, b in zip(g, gw, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fn", TABLED, ids=lambda f: f.__name__)
def test_tabled_calls_match_the_float64_reference(fn):  # noqa: ANN001
    torch.manual_seed(2)
    q = torch.randn(1, 4, 70, 32, dtype=torch.float64)
    k, v = torch.randn(1, 4, 300, 32, dtype=torch.float64), torch.randn(1, 4, 300, 32,
                                                                        dtype=torch.float64)
    ref = ak.attention(q, k, v, is_causal=True, score_mod=fn, backend="reference")
    for dtype in (torch.float32, torch.bfloat16):
        with counting() as n:
            out = ak.attention(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=True,
                               score_mod=fn)
        assert n["native"] == 1, n
        low = ak.attention(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=True, score_mod=fn,
                           backend="reference")
        assert_low_precision_close(out, low, ref)


def test_tables_follow_the_flush_to_zero_mode(monkeypatch: pytest.MonkeyPatch):
    """A table filled by an earlier call is not read under another float mode (FTZ / DAZ /
    rounding): with flush-to-zero on, the tabled call gives the bits of the untabled one
    (which computes every value afresh, flushed). One thread: the mode is per thread."""
    def tiny(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return score + (torch.exp(-(q_idx - kv_idx).abs().float()) * 1e-38) * 1e38

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(4)
        q, k, v = (torch.randn(1, 1, 64, 16) for _ in range(3))
        got = []
        for untabled in (False, True):
            if untabled:
                _untabled(monkeypatch)
            sm.clear()
            torch.set_flush_denormal(False)
            plain = ak.attention(q, k, v, score_mod=tiny)
            torch.set_flush_denormal(True)
            flushed = ak.attention(q, k, v, score_mod=tiny)
            torch.set_flush_denormal(False)
            got.append((plain, flushed))
        sm.clear()
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)
    (tab_plain, tab_flushed), (raw_plain, raw_flushed) = got
    assert not torch.equal(raw_plain, raw_flushed)          # the mode changes the answer
    assert torch.equal(tab_plain, raw_plain) and torch.equal(tab_flushed, raw_flushed)


def test_the_fill_computes_only_what_the_tables_read():
    """A flagging node outside every table's inputs (``h // 2``) does not cost the tables;
    more than four tables are not made (per-thread memory)."""
    def head_halves(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return score + torch.sqrt((q_idx - kv_idx).abs().float()) + (h // 2)

    def five(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        d = (q_idx - kv_idx).abs().float()
        parts = [torch.where(score > i, torch.exp(-d * i), d.sqrt()) for i in range(5)]
        return score + sum(parts)

    assert "ak_fill" in _source(head_halves)
    assert _plan(five) is None
