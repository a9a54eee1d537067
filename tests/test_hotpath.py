"""The lean hot path of small calls (issue 20, item 3): the fast checks that accept a call in a
few comparisons agree with the full checks they stand in front of, value-dependent screens
still run on every call (nothing about a call's values is remembered from an earlier call of
the same signature), errors are the same on every repeat, and ``backend="auto"``'s quick
``can_run`` answers agree with each backend's reasons.

Shape legend: q (B, H_q, N_q, D_k), k (B, H_kv, N_k, D_k), v (B, H_kv, N_k, D_v).
"""

from __future__ import annotations

import itertools
import math
import re
import threading

import pytest
import torch

import attnkit as ak
from attnkit import _compat, api, eager, masks
from attnkit.backends import REGISTRY, native
from attnkit.backends.base import Problem
from helpers.tolerance import assert_low_precision_close

# ============================================================ values are never remembered


def _decode_qkv(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(1, 8, 1, 64, dtype=dtype), torch.randn(1, 2, 192, 64, dtype=dtype),
            torch.randn(1, 2, 192, 64, dtype=dtype)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entry", ["attention", "sdpa"])
def test_same_signature_new_values_are_screened_every_call(entry, dtype):
    """A call signature that ran clean before is screened again: NaN in an allowed K row
    gives NaN (its K/V head's queries only), NaN in a blocked row stays out, inf in V with no
    mask gives NaN (not inf) — each right after clean calls of the same shapes."""
    q, k, v = _decode_qkv(dtype)
    pad = masks.padding(torch.tensor([100]))             # keys 100.. blocked

    def call(k: torch.Tensor, v: torch.Tensor, mask: object = None) -> torch.Tensor:
        if entry == "attention":
            return ak.attention(q, k, v, mask=mask)
        m = None if mask is None else mask.to_dense(1, 192).reshape(1, 192)  # type: ignore[union-attr]
        return ak.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)

    with torch.no_grad():
        for _ in range(3):
            assert torch.isfinite(call(k, v)).all()
            assert torch.isfinite(call(k, v, pad)).all()
        k_nan = k.clone()
        k_nan[0, 1, 50] = math.nan                       # allowed row of K/V head 1
        out = call(k_nan, v)
        assert out[0, 4:].isnan().all() and torch.isfinite(out[0, :4]).all()
        k_blocked = k.clone()
        k_blocked[0, :, 150] = math.nan                  # a padded row: never reaches output
        v_blocked = v.clone()
        v_blocked[0, :, 190] = math.inf
        clean = call(k, v, pad)
        got = call(k_blocked, v_blocked, pad)
        assert torch.isfinite(got).all() and torch.equal(got, clean)
        v_inf = v.clone()
        v_inf[0, 0, 3] = math.inf                        # no mask: every query attends to it
        out = call(k, v_inf)
        assert out[0, :4].isnan().all() and torch.isfinite(out[0, 4:]).all()
        assert torch.isfinite(call(k, v)).all()          # and clean again afterwards


def test_nan_query_row_still_nan_after_clean_calls():
    q, k, v = (torch.randn(1, 8, 128, 64) for _ in range(3))
    with torch.no_grad():
        for _ in range(2):
            assert torch.isfinite(ak.attention(q, k, v, is_causal=True)).all()
        q_bad = q.clone()
        q_bad[0, 3, 7, 0] = math.nan
        out = ak.attention(q_bad, k, v, is_causal=True)
    assert out[0, 3, 7].isnan().all()
    assert torch.isfinite(out[0, 3, :7]).all() and torch.isfinite(out[0, :3]).all()


def test_minus_inf_query_row_gives_nan_after_clean_calls():
    """A query row of −∞ whose every score is −∞ (keys all positive) attends to keys it may
    see: NaN, as the tiled engine's query screen gives — also on a repeat of a clean
    signature, where the kernel alone would call the row empty (output 0)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 8, 40, 16), torch.rand(1, 8, 40, 16) + 0.5, torch.randn(1, 8, 40, 16)
    with torch.no_grad():
        for _ in range(3):
            assert torch.isfinite(ak.attention(q, k, v, is_causal=True)).all()
        q_bad = q.clone()
        q_bad[0, 3, 7] = -math.inf
        out = ak.attention(q_bad, k, v, is_causal=True)
    assert out[0, 3, 7].isnan().all()
    assert torch.isfinite(out[0, 3, :7]).all() and torch.isfinite(out[0, :3]).all()


def test_score_mod_minus_inf_on_nan_v_row_still_gives_nan():
    """A Python score_mod's −∞ is a score, not a mask: a NaN V row it removes still gives
    NaN — on the first call and on a repeat with new values."""
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))

    def drop_key_0(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return torch.where(kv_idx == 0, -math.inf, score)

    with torch.no_grad():
        assert torch.isfinite(ak.attention(q, k, v, score_mod=drop_key_0)).all()
        v_bad = v.clone()
        v_bad[0, 0, 0] = math.nan
        assert ak.attention(q, k, v_bad, score_mod=drop_key_0)[0, 0].isnan().all()
        m = masks.from_fn(lambda b, h, q_idx, kv_idx: kv_idx != 0)
        assert torch.isfinite(ak.attention(q, k, v_bad, mask=m)).all()   # a mask removes it


# ============================================================ errors: the same every time
BAD_CALLS = [
    # (q, k, v) shapes / dtypes, expected error type, a fragment of its message
    (((2, 3, 4, 8), (2, 2, 4, 8), (2, 2, 4, 8)), ValueError, "must be a multiple"),
    (((2, 4, 4, 8), (2, 2, 4, 7), (2, 2, 4, 8)), ValueError, "same feature width D_k"),
    (((2, 4, 4, 8), (2, 2, 5, 8), (2, 2, 4, 8)), ValueError, "same number of keys N_k"),
    (((2, 4, 4, 8), (3, 2, 4, 8), (3, 2, 4, 8)), ValueError, "same leading (batch) dims"),
    (((2, 4, 4, 8), (2, 2, 4, 8), (2, 1, 4, 8)), ValueError, "same number of heads H_kv"),
    (((2, 4, 4, 8), (2, 0, 4, 8), (2, 0, 4, 8)), ValueError, "no heads (H_kv=0)"),
    (((4, 8), (2, 2, 4, 8), (2, 2, 4, 8)), ValueError, "same rank"),
    (((8,), (8,), (8,)), ValueError, "must be 2-D"),
]


@pytest.mark.parametrize(("shapes", "err", "fragment"), BAD_CALLS)
def test_bad_call_raises_the_same_error_every_time(shapes, err, fragment):
    qkv = [torch.randn(*s) for s in shapes]
    messages = []
    for _ in range(3):
        with pytest.raises(err, match=re.escape(fragment)) as e:
            ak.attention(*qkv)
        messages.append(str(e.value))
    ak.attention(*(torch.randn(2, 4, 4, 8) for _ in range(3)))      # a good call between
    with pytest.raises(err) as e:
        ak.attention(*qkv)
    assert len(set(messages)) == 1 and str(e.value) == messages[0]


def test_dtype_and_device_errors_repeat():
    q, k, v = (torch.randn(1, 2, 3, 4) for _ in range(3))
    for _ in range(2):
        with pytest.raises(TypeError, match="share one dtype"):
            ak.attention(q, k.double(), v)
        with pytest.raises(TypeError, match="floating-point"):
            ak.attention(q.int(), k.int(), v.int())
        with pytest.raises(ValueError, match="on one device"):
            ak.attention(q, k.to("meta"), v)
        with pytest.raises(ValueError, match="dropout_p must be a number in"):
            ak.scaled_dot_product_attention(q, k, v, dropout_p=1.5)
        with pytest.raises(ValueError, match="dropout_p must be a number in"):
            ak.scaled_dot_product_attention(q, k, v, dropout_p=math.nan)
        with pytest.raises(ValueError, match="dropout_p must be a number in"):
            ak.scaled_dot_product_attention(q, k, v, dropout_p=True)
        with pytest.raises(TypeError, match="argument 'key' must be Tensor"):
            ak.scaled_dot_product_attention(q, k.numpy(), v)
        with pytest.raises(ValueError, match="must be a finite number"):
            ak.attention(q, k, v, dropout_p=math.inf)


# ============================================================ fast checks == full checks
def _full_check_passes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """The full checks of _check_qkv alone (its fast accept switched off)."""
    saved = eager._qkv_fit
    eager._qkv_fit = lambda *a: False  # type: ignore[assignment]
    try:
        eager._check_qkv(q, k, v)
        return True
    except (ValueError, TypeError):
        return False
    finally:
        eager._qkv_fit = saved  # type: ignore[assignment]


def test_fast_qkv_accept_never_accepts_what_the_full_check_refuses():
    sizes = (0, 1, 2, 3)
    dims = [(), (1,), (2,), (2, 1), (1, 2)]
    seen = 0
    for lead_q, lead_k in itertools.product(dims, dims):
        if len(lead_q) != len(lead_k):
            continue
        for h_q, h_kv, n_k_v in itertools.product(sizes, sizes, ((3, 3), (3, 2))):
            q = torch.empty(*lead_q, h_q, 2, 4)
            k = torch.empty(*lead_k, h_kv, n_k_v[0], 4)
            v = torch.empty(*lead_k, h_kv, n_k_v[1], 5)
            full = _full_check_passes(q, k, v)
            if eager._qkv_fit(q, k, v):
                assert full, (q.shape, k.shape, v.shape)
                seen += 1
    assert seen > 20
    for q, k, v in [(torch.empty(3, 4), torch.empty(5, 4), torch.empty(5, 2)),
                    (torch.empty(3, 4), torch.empty(5, 3), torch.empty(5, 2)),
                    (torch.empty(2, 3, 4), torch.empty(1, 3, 4), torch.empty(1, 3, 4))]:
        assert eager._qkv_fit(q, k, v) == _full_check_passes(q, k, v)


def test_sdpa_broadcast_is_torchs_broadcast():
    torch.manual_seed(0)
    dims = (1, 2, 3)
    for lq, lk, lv in itertools.product(itertools.product(dims, repeat=2), repeat=3):
        q, k, v = torch.empty(*lq, 4, 2, 8), torch.empty(*lk, 2, 3, 8), torch.empty(*lv, 2, 3, 8)
        try:
            lead = torch.broadcast_shapes(lq, lk, lv)
        except RuntimeError:
            with pytest.raises(ValueError, match="do not broadcast"):
                api._sdpa_broadcast(q, k, v, True)
            continue
        q2, k2, v2 = api._sdpa_broadcast(q, k, v, True)
        assert tuple(q2.shape) == (*lead, 4, 2, 8) and k2 is k and v2 is v
    # ranks padded on the left
    q2, k2, v2 = api._sdpa_broadcast(torch.empty(2, 4, 2, 8), torch.empty(2, 3, 8),
                                     torch.empty(2, 3, 8), True)
    assert (q2.shape, k2.shape, v2.shape) == ((2, 4, 2, 8), (1, 2, 3, 8), (1, 2, 3, 8))
    with pytest.raises(ValueError, match="do not broadcast"):
        api._sdpa_broadcast(torch.empty(0, 2, 2, 8), torch.empty(3, 2, 3, 8),
                            torch.empty(3, 2, 3, 8), True)


def test_mask_broadcast_rule_is_torchs():
    target = (2, 3, 4, 5)
    for shape in itertools.product((0, 1, 2, 3, 4, 5), repeat=2):
        for lead in ((), (1,), (2,), (3,), (1, 3), (2, 1), (2, 3), (1, 1, 1)):
            s = (*lead, *shape)
            try:
                ok = len(s) <= 4 and torch.broadcast_shapes(s, target) == torch.Size(target)
            except RuntimeError:
                ok = False
            assert eager._broadcasts_to(s, target) == ok, s


def test_native_fast_layout_accept_agrees_with_its_checks():
    good = (torch.empty(2, 4, 3, 8), torch.empty(2, 2, 5, 8), torch.empty(2, 2, 5, 6))
    assert native._layout_fits(*good)
    native._check_layout(*good)
    bad = [
        (torch.empty(2, 3, 3, 8), good[1], good[2]),                   # H_q % H_kv
        (good[0], torch.empty(2, 2, 5, 7), good[2]),                   # D_k
        (good[0], good[1], torch.empty(2, 2, 4, 6)),                   # N_k
        (good[0], good[1].double(), good[2]),                          # dtype
        (good[0].int(), good[1].int(), good[2].int()),                 # not a kernel dtype
        (good[0][0], good[1], good[2]),                                # 3-D
        (good[0], good[1].to("meta"), good[2]),                        # device
        (good[0], torch.empty(1, 2, 5, 8), torch.empty(1, 2, 5, 6)),   # batch
    ]
    for q, k, v in bad:
        assert not native._layout_fits(q, k, v)
        with pytest.raises((ValueError, TypeError)):
            native._check_layout(q, k, v)
        if native.available():
            with pytest.raises((ValueError, TypeError)) as e1:
                native.forward(q, k, v)
            with pytest.raises((ValueError, TypeError)) as e2:
                native.forward(q, k, v)
            assert str(e1.value) == str(e2.value) and "native.forward" in str(e1.value)


# ============================================================ backend="auto": can_run
def _problems() -> list[Problem]:
    out = []
    for dtype, n_q, grad, dropout in itertools.product(
            (torch.float32, torch.bfloat16, torch.float64), (1, 17), (False, True), (0.0, 0.1)):
        q = torch.randn(1, 4, n_q, 8, dtype=dtype, requires_grad=grad)
        k, v = torch.randn(1, 2, 9, 8, dtype=dtype), torch.randn(1, 2, 9, 8, dtype=dtype)
        out.append(api.prepare(q, k, v, dropout_p=dropout).problem)
        out.append(api.prepare(q, k, v, is_causal=True, softcap=5.0).problem)
    out.append(api.prepare(*(torch.randn(1, 2, 3, 300) for _ in range(3))).problem)
    return out


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_can_run_agrees_with_the_reasons(monkeypatch, interpret):
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    with torch.enable_grad():
        for p in _problems():
            for name, b in REGISTRY.items():
                assert b.can_run(p) == (not b.not_supported_reasons(p)), (name, p.describe())


def test_auto_picks_the_first_backend_without_reasons_and_lists_all_when_none_fits(
        monkeypatch):
    p = api.prepare(*(torch.randn(1, 2, 3, 4) for _ in range(3))).problem
    first = next(n for n in ak.backends.PRIORITY
                 if n in REGISTRY and not REGISTRY[n].not_supported_reasons(p))
    assert ak.backends.select(p).name == first
    for n in ak.backends.names():
        monkeypatch.setattr(REGISTRY[n], "extra_reasons", lambda p, n=n: [f"no {n}"])
    for _ in range(2):
        with pytest.raises(ValueError, match="no backend can run this call") as e:
            ak.backends.select(p)
        lines = str(e.value).splitlines()[1:]
        assert [ln.split(":")[0].strip() for ln in lines] == [
            n for n in ak.backends.PRIORITY if n in REGISTRY]


def test_triton_interpreter_switch_is_read_on_every_call(monkeypatch):
    p = api.prepare(*(torch.randn(1, 2, 3, 4) for _ in range(3))).problem
    tri = REGISTRY.get("triton")
    if tri is None:
        pytest.skip("triton backend not registered")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not tri.can_run(p)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tri.can_run(p) == (not tri.not_supported_reasons(p))
    assert "runs on CUDA" not in "; ".join(tri.not_supported_reasons(p))


def test_native_switch_is_read_on_every_call(monkeypatch):
    if not native.available():
        pytest.skip("native kernel unavailable")
    q, k, v = _decode_qkv()
    from attnkit.backends.tiled import counting
    with torch.no_grad():
        with counting() as c:
            ak.attention(q, k, v)
        assert c["native"] == 1
        monkeypatch.setenv("ATTNKIT_NATIVE", "0")
        with counting() as c:
            out = ak.attention(q, k, v)
        assert c["native"] == 0
        monkeypatch.delenv("ATTNKIT_NATIVE")
        with counting() as c:
            again = ak.attention(q, k, v)
        assert c["native"] == 1
    torch.testing.assert_close(out, again, rtol=1e-5, atol=1e-5)


def test_hot_path_from_many_threads():
    """Concurrent small calls of several signatures give each its own right answer."""
    torch.manual_seed(0)
    cases = []
    for n_k in (5, 64, 192):
        q, k, v = torch.randn(1, 8, 1, 16), torch.randn(1, 2, n_k, 16), torch.randn(1, 2, n_k, 16)
        with torch.no_grad():
            cases.append((q, k, v, ak.attention(q, k, v, backend="reference")))
    errors: list[str] = []

    def work(i: int) -> None:
        for j in range(40):
            q, k, v, want = cases[(i + j) % len(cases)]
            with torch.no_grad():
                got = ak.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
                errors.append(f"thread {i} call {j}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_restore_keeps_the_users_leading_dims():
    for lead in ((), (3,), (2, 3)):
        q, k, v = (torch.randn(*lead, 2, 5, 4) for _ in range(3))
        assert ak.attention(q, k, v).shape == (*lead, 2, 5, 4)
    q, k, v = (torch.randn(5, 4) for _ in range(3))
    assert ak.attention(q, k, v).shape == (5, 4)


# ============================================================ validated once per signature
def test_validation_runs_once_per_signature_and_values_every_call(monkeypatch):
    """A repeat of a call signature skips prepare()'s checks (counted on _check_qkv), and a
    bool mask tensor of the same shape but other values gives its own answer every call."""
    calls: list[int] = []
    real = eager._check_qkv
    monkeypatch.setattr(eager, "_check_qkv", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(eager, "_FRAMES", {})
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, 1, 8), torch.randn(3, 2, 11, 8), torch.randn(3, 2, 11, 8)
    masks_ = [torch.rand(3, 1, 1, 11) > p for p in (0.2, 0.5, 0.8)]
    for m in masks_:
        m[:, :, :, 0] = True                                 # every query keeps a key
    with torch.no_grad():
        for _ in range(2):
            for m in masks_:
                got = ak.attention(q, k, v, mask=m)
                want = ak.attention(q.double(), k.double(), v.double(), mask=m,
                                    backend="reference")
                torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
            ak.attention(q, k, v)
            ak.attention(q, k, v, is_causal=True)
    # four signatures (mask / none / causal, and the float64 reference's), each checked once
    assert len(calls) == 4
    ak.attention(q[:2], k[:2], v[:2])                        # a new signature: checked
    assert len(calls) == 5


@pytest.mark.parametrize("shapes", [
    ((5, 8), (7, 8), (7, 4)),                                # 2-D: one head
    ((4, 5, 8), (2, 7, 8), (2, 7, 8)),                       # 3-D: no batch
    ((2, 3, 4, 5, 8), (1, 1, 2, 7, 8), (1, 1, 2, 7, 8)),      # K/V broadcast over the batch
    ((2, 3, 4, 5, 8), (2, 1, 2, 7, 8), (2, 1, 2, 7, 8)),      # ... in one leading dim only
])
def test_a_repeated_signature_gives_the_first_calls_answer_and_layout(shapes):
    torch.manual_seed(0)
    for _ in range(2):
        q, k, v = (torch.randn(*s) for s in shapes)
        m = torch.rand(shapes[0][-2], shapes[1][-2]) > 0.3
        m[:, 0] = True
        for kw in ({}, {"is_causal": True}, {"mask": m}):
            got = [ak.attention(q, k, v, **kw) for _ in range(3)]
            want = ak.attention(q, k, v, backend="reference", **kw)
            for g in got:
                assert g.shape == want.shape
                torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5)


def test_the_frames_are_bounded(monkeypatch):
    monkeypatch.setattr(eager, "_FRAMES", {})
    for n in range(eager._FRAMES_MAX + 10):
        ak.attention(torch.randn(1, 1, 1, 4), torch.randn(1, 1, n + 1, 4),
                     torch.randn(1, 1, n + 1, 4))
    assert 0 < len(eager._FRAMES) <= eager._FRAMES_MAX


def test_a_bool_mask_is_read_as_given_with_the_evaluated_masks_result():
    """Problem.mask_tensor (the call's bool tensor, read without evaluating the Mask) gives
    bit for bit what evaluating the Mask gives, on the native kernel and the Python engine."""
    import dataclasses

    torch.manual_seed(0)
    q, k, v = torch.randn(4, 8, 3, 16), torch.randn(4, 2, 40, 16), torch.randn(4, 2, 40, 16)
    for shape in ((4, 1, 3, 40), (4, 1, 1, 40), (1, 8, 3, 40), (3, 40)):
        m = torch.rand(*shape) > 0.4
        p = api.prepare(q, k, v, mask=m).problem
        assert p.mask_tensor is not None
        slow = dataclasses.replace(p, mask_tensor=None)
        with torch.no_grad():
            for name in ("decode", "tiled"):
                b = REGISTRY[name]
                out, lse = b.forward(p)
                out2, lse2 = b.forward(slow)
                assert torch.equal(out, out2) and torch.equal(lse, lse2), (name, shape)


def test_native_switch_values_are_read_as_before(monkeypatch):
    from attnkit.backends.native import loader

    if not native.available():
        pytest.skip("native kernel unavailable")
    for off in ("0", "false", " OFF ", "no"):
        monkeypatch.setenv("ATTNKIT_NATIVE", off)
        assert loader.load() is None and "ATTNKIT_NATIVE=0" in loader.reason()
    for on in ("1", "yes", ""):
        monkeypatch.setenv("ATTNKIT_NATIVE", on)
        assert loader.load() is not None
    monkeypatch.delenv("ATTNKIT_NATIVE")
    assert loader.load() is not None


def test_native_dense_mask_that_does_not_broadcast_is_refused():
    if not native.available():
        pytest.skip("native kernel unavailable")
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    for bad in (torch.ones(2, 2, 3, 5, dtype=torch.bool), torch.ones(3, 4, dtype=torch.bool)):
        with pytest.raises(ValueError, match="does not broadcast to"):
            native.forward(q, k, v, dense_mask=bad)


def test_capability_fits_agrees_with_the_reasons():
    from attnkit.backends.base import Capabilities

    with torch.enable_grad():
        problems = _problems()
        for caps in (Capabilities(), Capabilities(devices=("cuda",)),
                     Capabilities(dtypes=(torch.float64,)), Capabilities(max_head_dim=8),
                     Capabilities(max_head_dim=7), Capabilities(max_queries=1),
                     Capabilities(grad=False), Capabilities(dropout=False),
                     Capabilities(score_mod=False), Capabilities(devices=None, dtypes=None)):
            for p in problems:
                assert caps.fits(p) == (not caps.reasons(p)), (caps, p.describe())


def test_a_backend_with_reasons_of_its_own_is_asked_them():
    from attnkit.backends.base import Backend

    class Picky(Backend):
        name = "picky"

        def not_supported_reasons(self, p):  # noqa: ANN001, ANN202
            return ["never"]

    p = api.prepare(*(torch.randn(1, 2, 3, 4) for _ in range(3))).problem
    assert not Picky().can_run(p)
    b = Backend()
    assert b.can_run(p)
    b.not_supported_reasons = lambda p: ["patched"]  # type: ignore[method-assign]
    assert not b.can_run(p)


def test_one_mask_tensor_changed_in_place_between_calls_gives_its_new_values():
    """A model passes one mask tensor to every layer; the same tensor object, written in
    place between calls (or viewed with other strides), is read as it is now."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 12, 8), torch.randn(2, 2, 12, 8)
    m = torch.ones(2, 1, 1, 12, dtype=torch.bool)
    sq = torch.ones(12, 12, dtype=torch.bool).tril()
    qs = torch.randn(2, 4, 12, 8)
    with torch.no_grad():
        for step in range(4):
            m[:, :, :, step] = False
            for _ in range(2):
                got = ak.attention(q, k, v, mask=m)
                want = ak.attention(q, k, v, mask=m.clone(), backend="reference")
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for _ in range(2):
            want = ak.attention(qs, k, v, mask=sq.clone(), backend="reference")
            torch.testing.assert_close(ak.attention(qs, k, v, mask=sq), want,
                                       rtol=1e-5, atol=1e-6)
            sq.t_()                                   # same object, same memory, new strides


def test_bench_hf_generate_arguments(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_hf_generate.py"
    for args, said in ((["--rounds", "0"], "at least 1"), (["--new-tokens", "0"], "at least 1"),
                       (["--trees", str(tmp_path)], "two source trees"),
                       (["--trees", str(tmp_path), str(tmp_path)], "has no src/attnkit")):
        got = subprocess.run([sys.executable, str(script), *args], capture_output=True,
                             text=True)
        assert got.returncode == 2 and said in got.stderr, (args, got.stderr)


def test_a_frame_lowers_its_mask_once_and_a_new_mask_tensor_anew(monkeypatch):
    """Repeats of a signature reuse the lowering (masks.decompose) of the frame's mask —
    is_causal once per signature, a bool mask tensor once per tensor object and memory —
    while every call reads the mask tensor's values as they are now."""
    from attnkit.backends import base

    lowered: list[int] = []
    real = base.decompose
    monkeypatch.setattr(base, "decompose", lambda *a: lowered.append(1) or real(*a))
    monkeypatch.setattr(eager, "_FRAMES", {})
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 11, 8), torch.randn(2, 2, 11, 8)
    m = torch.ones(2, 1, 3, 11, dtype=torch.bool)
    with torch.no_grad():
        for _ in range(3):
            ak.attention(q, k, v, is_causal=True)
        assert len(lowered) == 1
        for blocked in (0, 4, 7):                    # the same tensor, new values in place
            m.fill_(True)
            m[..., :blocked] = False
            got = ak.attention(q, k, v, mask=m)
            want = ak.attention(q.double(), k.double(), v.double(), mask=m,
                                backend="reference")
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
        n = len(lowered)
        ak.attention(q, k, v, mask=m)                # the same tensor: lowered before
        assert len(lowered) == n
        other = m.clone()
        other[..., :9] = False
        got = ak.attention(q, k, v, mask=other)      # a new tensor: lowered at most anew
        assert len(lowered) <= n + 1                 # (the lean lane passes it as it is)
        want = ak.attention(q.double(), k.double(), v.double(), mask=other,
                            backend="reference")
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_sdpa_outside_autocast_is_attentions_eager_call():
    """ak.scaled_dot_product_attention goes straight to the eager path outside autocast and
    compile, and gives what ak.attention gives (causal, a bool mask, GQA)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    m = torch.rand(2, 1, 5, 7) > 0.3
    with torch.no_grad():
        for kw, akw in (({"is_causal": True}, {"is_causal": True}),
                        ({"attn_mask": m}, {"mask": m})):
            got = ak.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
            assert torch.equal(got, ak.attention(q, k, v, **akw))


# ============================================================ the lean lane (a frame's repeats)
def _warm(call, n: int = 3) -> None:
    for _ in range(n):
        call()


def test_a_repeated_decode_call_skips_select_and_the_glue(monkeypatch):
    """A repeat of a decode signature (no mask, or a bool mask tensor) runs on the kernel's
    lean operator: neither ``backends.select`` nor ``native.forward_problem`` is called, the
    native counter still counts it, and the answer is the full path's, bit for bit."""
    if not native.available():
        pytest.skip("native kernel unavailable")
    monkeypatch.setattr(eager, "_FRAMES", {})
    q, k, v = _decode_qkv()
    m = torch.ones(1, 1, 1, 192, dtype=torch.bool)
    m[..., :20] = False
    from attnkit.backends.tiled import counting
    with torch.no_grad():
        full = [ak.attention(q, k, v, backend="decode"),
                ak.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)]
        _warm(lambda: ak.attention(q, k, v))
        _warm(lambda: ak.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True))
        seen: list[str] = []
        real_select, real_fp = ak.backends.select, native.forward_problem
        monkeypatch.setattr(eager._backends, "select",
                            lambda *a: seen.append("select") or real_select(*a))
        monkeypatch.setattr(native, "forward_problem",
                            lambda *a: seen.append("forward_problem") or real_fp(*a))
        monkeypatch.setattr(eager, "_SELECT", eager._backends.select)   # (the spy is select)
        _warm(lambda: ak.attention(q, k, v), 1)                         # the lanes anew
        _warm(lambda: ak.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True),
              1)
        assert "select" in seen
        seen.clear()
        with counting() as c:
            lean = [ak.attention(q, k, v),
                    ak.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)]
        assert c["native"] == 2
    assert seen == []
    for a, b in zip(lean, full, strict=True):
        assert torch.equal(a, b)


def test_the_lean_lane_honours_scopes_switches_registry_edits_and_grad(monkeypatch):
    """What ``backend="auto"`` would choose is chosen on every repeat: a ``use`` scope, a
    forced name, ``use_native(False)``, ``ATTNKIT_NATIVE=0``, a backend registered ahead, a
    patched ``extra_reasons``, inputs that need gradients and a new thread count each change
    the choice at once, and the lane comes back after."""
    if not native.available():
        pytest.skip("native kernel unavailable")
    from attnkit.backends import tiled
    from attnkit.backends.base import Backend, Capabilities
    from attnkit.backends.tiled import counting

    monkeypatch.setattr(eager, "_FRAMES", {})
    q, k, v = _decode_qkv()
    runs: list[str] = []
    for name in ("tiled", "reference"):            # the method the eager path calls first
        cls = type(REGISTRY[name])
        method = "forward_screened" if "forward_screened" in vars(cls) else "forward"
        monkeypatch.setattr(cls, method,
                            lambda self, p, real=getattr(cls, method): runs.append(self.name)
                            or real(self, p))

    def call() -> torch.Tensor:
        return ak.attention(q, k, v)

    def lean() -> bool:                    # the decode backend on the native kernel ran it
        runs.clear()
        with counting() as c:
            call()
        return c["native"] == 1 and not runs

    with torch.no_grad():
        _warm(call)
        assert lean()
        with ak.backends.use("reference"):
            call()
            assert runs == ["reference"]
        with ak.backends.use(["tiled", "reference"]):
            runs.clear()
            call()
            assert runs == ["tiled"]
        runs.clear()
        ak.attention(q, k, v, backend="tiled")
        assert runs == ["tiled"]
        assert lean()
        with tiled.use_native(False), counting() as c:
            call()
        assert c["native"] == 0
        monkeypatch.setenv("ATTNKIT_NATIVE", "0")
        with counting() as c:
            call()
        assert c["native"] == 0
        monkeypatch.delenv("ATTNKIT_NATIVE")
        assert lean()

        class Ahead(Backend):
            name = "test_lane_ahead"
            capabilities = Capabilities(devices=("cpu",))

            def forward(self, p):  # noqa: ANN001, ANN202
                runs.append(self.name)
                return REGISTRY["reference"].forward(p)

        saved = dict(REGISTRY), list(ak.backends.PRIORITY)
        try:
            ak.backends.register(Ahead(), before="decode")
            runs.clear()
            call()
            assert runs[0] == "test_lane_ahead"
        finally:
            REGISTRY.clear()
            REGISTRY.update(saved[0])
            ak.backends.PRIORITY[:] = saved[1]
        assert lean()
        monkeypatch.setattr(REGISTRY["decode"], "extra_reasons", lambda p: ["not today"])
        runs.clear()
        call()
        assert runs == ["tiled"]
        monkeypatch.delattr(REGISTRY["decode"], "extra_reasons")
        assert lean()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(1, threads // 2) if threads > 1 else 2)
        with torch.no_grad():
            assert lean()
    finally:
        torch.set_num_threads(threads)
    qg = q.clone().requires_grad_()
    runs.clear()
    out = ak.attention(qg, k, v)
    assert out.grad_fn is not None and runs == ["tiled"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entry", ["attention", "sdpa"])
def test_the_lean_lane_takes_rows_with_a_strided_last_dim(entry, dtype):
    """A frame's repeat whose q, k or v has a strided last dim (same shapes as the calls that
    made the lane: a view of a wider tensor) runs on the lean operator, which copies such
    rows itself (nothing in Python reads the strides), and gives the full path's answer
    bit for bit — within DESIGN's budget of the float64 reference."""
    if not native.available():
        pytest.skip("native kernel unavailable")
    from attnkit.backends.tiled import counting
    from helpers.tolerance import assert_low_precision_close

    torch.manual_seed(1)
    q, k, v = _decode_qkv(dtype)
    wide = [torch.randn(*t.shape[:-1], 2 * t.shape[-1], dtype=dtype) for t in (q, k, v)]
    views = [w[..., ::2] for w in wide]                        # (…, D) with stride 2 along D
    assert all(t.stride(-1) == 2 for t in views)

    def call(q_, k_, v_):
        if entry == "sdpa":
            return ak.scaled_dot_product_attention(q_, k_, v_, enable_gqa=True)
        return ak.attention(q_, k_, v_)

    with torch.no_grad():
        _warm(lambda: call(q, k, v))                           # the lane, on contiguous rows
        for strided in itertools.product((False, True), repeat=3):
            if not any(strided):
                continue
            args = [view if s else t for t, view, s in zip((q, k, v), views, strided,
                                                           strict=True)]
            with counting() as c:
                got = call(*args)
            assert c["native"] == 1
            full = ak.attention(*(a.contiguous() for a in args), backend="decode")
            assert torch.equal(got, full), strided
            ref64 = ak.attention(*(a.double() for a in args), backend="reference")
            if dtype == torch.float32:
                torch.testing.assert_close(got.double(), ref64, rtol=1e-5, atol=1e-6)
            else:
                ref_lowp = ak.attention(*args, backend="reference")
                assert_low_precision_close(got, ref_lowp, ref64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_lean_operator_is_attend_and_flags_non_finite_outputs(dtype):
    """``attend_lean`` gives what ``attend`` gives for the same call (no mask, a band, a
    broadcast bool mask), and its flag says whether every output element (and, asked, every
    query element) is finite."""
    if not native.available():
        pytest.skip("native kernel unavailable")
    ops = native.loader.load()
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 3, 8).to(dtype), torch.randn(2, 2, 37, 8).to(dtype),
               torch.randn(2, 2, 37, 8).to(dtype))
    m = torch.rand(2, 1, 1, 37) > 0.3
    inf = math.inf
    for mask, band in ((None, (-inf, inf)), (m, (-inf, inf)), (None, (-34.0, 0.0)),
                       (m, (-40.0, -30.0))):
        rec = native.plain_terms(0.3, band=band)._replace(mask=mask)
        want = ops.attend(q, k, v, *rec, 1, 3)
        out, lse, finite = ops.attend_lean(q, k, v, 0.3, 0.0, *band, mask, 1, 3, True)
        assert finite and torch.equal(out, want[0]) and torch.equal(lse, want[1])
    v_bad = v.clone()
    v_bad[1, 0, 5, 2] = math.inf
    out, _, finite = ops.attend_lean(q, k, v_bad, 0.3, 0.0, -inf, inf, None, 1, 3, False)
    assert not finite and not torch.isfinite(out).all()
    blocked = (torch.arange(37) != 5).reshape(1, 1, 1, 37)    # the inf row stays out
    out, _, finite = ops.attend_lean(q, k, v_bad, 0.3, 0.0, -inf, inf, blocked, 1, 3, False)
    assert finite and torch.isfinite(out).all()
    q_bad = q.clone()
    q_bad[0, 3, 2, 1] = -math.inf        # a query row that sees no key: output 0 (finite)
    no_key = torch.ones(2, 4, 3, 37, dtype=torch.bool)
    no_key[0, 3, 2] = False
    for check_q in (False, True):
        out, _, finite = ops.attend_lean(q_bad, k, v, 0.3, 0.0, -inf, inf, no_key, 1, 3,
                                         check_q)
        assert torch.isfinite(out).all() and finite == (not check_q)


def test_a_repeated_empty_call_selects_nothing(monkeypatch):
    """A call with no score to compute never reaches a backend, also on its repeats: a
    backend that could not run it (triton on CPU tensors) may be named every time."""
    monkeypatch.setattr(eager, "_FRAMES", {})
    name = "triton" if "triton" in REGISTRY else "reference"
    q, k, v = torch.randn(1, 2, 0, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 4)
    with torch.no_grad():
        for _ in range(3):
            assert ak.attention(q, k, v, backend=name).shape == (1, 2, 0, 4)


def test_a_warm_cpu_signature_takes_no_tensor_on_another_device(monkeypatch):
    """The frames' key names the device only when q, k, v are not all on the CPU: after the
    CPU signature's lane has formed, the same shapes with any one of them on another device
    still get the device error, and the CPU call its answer."""
    monkeypatch.setattr(eager, "_FRAMES", {})
    q, k, v = _decode_qkv()
    with torch.no_grad():
        _warm(lambda: ak.attention(q, k, v))
        for i in range(3):
            args = [q, k, v]
            args[i] = args[i].to("meta")
            with pytest.raises(ValueError, match="on one device"):
                ak.attention(*args)
        want = ak.attention(q, k, v, backend="reference")
        torch.testing.assert_close(ak.attention(q, k, v), want, atol=1e-5, rtol=1e-5)


def test_a_warm_lane_still_checks_the_backend_name(monkeypatch):
    """``attention`` asks no function about backend="auto" (the hot path's plain comparison):
    a name that is no string, or no backend, is refused as before after warm calls."""
    monkeypatch.setattr(eager, "_FRAMES", {})
    q, k, v = _decode_qkv()
    with torch.no_grad():
        _warm(lambda: ak.attention(q, k, v))
        with pytest.raises(TypeError, match="backend must be a string"):
            ak.attention(q, k, v, backend=1)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="unknown backend 'autox'"):
            ak.attention(q, k, v, backend="autox")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lean_launch_passes_scale_and_softcap(monkeypatch, dtype):
    """The lean launch's one-tuple arguments (``LeanLaunch.tail``) are its fields: a repeated
    decode call with its own scale and soft-cap matches the float64 reference within the
    dtype's tolerance on every repeat."""
    if not native.available():
        pytest.skip("native kernel unavailable")
    monkeypatch.setattr(eager, "_FRAMES", {})
    q, k, v = _decode_qkv(dtype)
    q = q * 4
    want = ak.attention(q.double(), k.double(), v.double(), scale=0.3, softcap=2.0,
                        backend="reference")
    low = ak.attention(q, k, v, scale=0.3, softcap=2.0, backend="reference")
    with torch.no_grad():
        for _ in range(4):
            got = ak.attention(q, k, v, scale=0.3, softcap=2.0)
            assert_low_precision_close(got, low, want)
    launches = [f.lane.launch for f in eager._FRAMES.values()
                if f.lane is not None and f.lane.launch is not None]
    assert launches
    for la in launches:
        assert la.tail == (la.scale, la.softcap, la.band_lo, la.band_hi, None, la.splits,
                           la.block_q, la.check_q)
        assert la.scale == 0.3 and la.softcap == 2.0


# ============================================================ attention()'s per-token call
def test_attentions_per_token_call_misses_on_gradients_and_new_signatures(monkeypatch):
    """``attnkit.attention`` runs a warm frame's repeat on the lean operator itself (its
    own copy of eager.attend's hot path): inputs that need gradients (any one of q, k, v)
    must miss it and get a graph with the reference's gradients, and a call of another
    shape, dtype or strides is answered as the full path answers it — a new shape or dtype
    in a frame of its own."""
    if not native.available():
        pytest.skip("native kernel unavailable")
    from attnkit.backends.tiled import counting

    monkeypatch.setattr(eager, "_FRAMES", {})
    q, k, v = _decode_qkv()
    entered: list[str] = []
    real_attend = eager.attend
    monkeypatch.setattr(eager, "attend", lambda *a, **kw: entered.append("attend")
                        or real_attend(*a, **kw))
    with torch.no_grad():
        _warm(lambda: ak.attention(q, k, v))
        entered.clear()
        with counting() as c:
            ak.attention(q, k, v)
        assert c["native"] == 1 and len(eager._FRAMES) == 1
        assert entered == []                            # the key is eager's, the lane held
    go = torch.randn(1, 8, 1, 64)
    for i in range(3):                                  # one of q, k, v needs a gradient
        leaves = [t.clone().requires_grad_(j == i) for j, t in enumerate((q, k, v))]
        out = ak.attention(*leaves)
        assert out.grad_fn is not None, i
        (g,) = torch.autograd.grad(out, leaves[i], go)
        ref = [t.detach().double().requires_grad_(j == i) for j, t in enumerate(leaves)]
        (g_ref,) = torch.autograd.grad(ak.attention(*ref, backend="reference"), ref[i],
                                       go.double())
        torch.testing.assert_close(g.double(), g_ref, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        k2, v2 = torch.randn(1, 2, 193, 64), torch.randn(1, 2, 193, 64)   # one key more
        for args in ((q, k2, v2), (q.double(), k.double(), v.double()),
                     (q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v)):
            want = ak.attention(*(a.contiguous() for a in args), backend="reference")
            got = ak.attention(*args)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert len(eager._FRAMES) == 3                  # (the strided k: the same frame)
        for i in range(3):                              # one dtype apart: the full check's
            args = [t.double() if j == i else t for j, t in enumerate((q, k, v))]
            with pytest.raises(TypeError, match="share one dtype"):
                ak.attention(*args)


def test_attentions_per_token_call_follows_the_thread_count(monkeypatch):
    """The lean launch's key splits depend on the thread count: a new count makes the lane
    anew (once), and the launch then used is the one for that count."""
    if not native.available():
        pytest.skip("native kernel unavailable")
    monkeypatch.setattr(eager, "_FRAMES", {})
    q, k, v = _decode_qkv()
    made: list[int] = []
    real = eager._make_lane
    monkeypatch.setattr(eager, "_make_lane",
                        lambda *a: made.append(torch.get_num_threads()) or real(*a))
    threads = torch.get_num_threads()
    other = max(1, threads // 2) if threads > 1 else 2
    try:
        with torch.no_grad():
            _warm(lambda: ak.attention(q, k, v))
            assert made == [threads]
            torch.set_num_threads(other)
            _warm(lambda: ak.attention(q, k, v))
            assert made == [threads, other]
            (frame,) = eager._FRAMES.values()
            assert frame.lane.state[5] == other
    finally:
        torch.set_num_threads(threads)


def test_attention_asks_the_compiling_flag(monkeypatch):
    """attention() tells a trace from an eager call without torch.compiler.is_compiling()'s
    two functions where torch has is_dynamo_compiling() and the flag is_compiling() reads:
    the flag set (as torch.export and a torch.compile session set it) gives the traced call."""
    import inspect

    if "_is_compiling_flag" in inspect.getsource(torch.compiler.is_compiling) \
            and hasattr(torch.compiler, "is_dynamo_compiling"):
        assert _compat.FLAG_READ and api._compiling is not torch.compiler.is_compiling
    seen: list[str] = []
    monkeypatch.setattr(api, "_traced", lambda *a, **kw: seen.append("traced") or "traced")
    q, k, v = _decode_qkv()
    with torch.no_grad():
        _warm(lambda: ak.attention(q, k, v))
        monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True, raising=False)
        if not _compat.FLAG_READ:
            monkeypatch.setattr(api, "_compiling", lambda: True)
        assert ak.attention(q, k, v) == "traced" and seen == ["traced"]


def test_attentions_last_hot_frame_is_tried_first_and_checks_its_options(monkeypatch):
    """A repeat of the last lean call's signature runs on ``attend_slot`` without the
    frame's key (no ``eager._lane_holds``, which the keyed path asks); a call with other
    options (is_causal, scale, softcap, return_lse) or another signature is answered as the
    reference answers it, and the hot frame follows the last lean call."""
    if not native.available():
        pytest.skip("native kernel unavailable")
    monkeypatch.setattr(eager, "_FRAMES", {})
    asked: list[str] = []
    real = eager._lane_holds
    monkeypatch.setattr(eager, "_lane_holds", lambda *a: asked.append("holds") or real(*a))
    q, k, v = _decode_qkv()
    with torch.no_grad():
        _warm(lambda: ak.attention(q, k, v))
        hot = eager._HOT
        assert hot is not None and hot.frames is eager._FRAMES
        assert [tuple(s.shape) for s in hot.sigs] == [tuple(t.shape) for t in (q, k, v)]
        asked.clear()
        out = ak.attention(q, k, v)
        assert asked == []                              # the hot frame, not the key
        assert torch.equal(out, ak.attention(q, k, v, backend="decode"))
        for options in ({"is_causal": True}, {"scale": 0.3}, {"softcap": 5.0}):
            want = ak.attention(q.double(), k.double(), v.double(), backend="reference",
                                **options)
            _warm(lambda: ak.attention(q, k, v), 2)     # the plain frame hot
            assert eager._HOT is hot
            for _ in range(3):                          # (then its own frame, hot)
                got = ak.attention(q, k, v, **options)
                torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
        assert eager._HOT is not hot                    # (softcap's frame now)
        _warm(lambda: ak.attention(q, k, v), 2)         # back, through the key (the lane
        #                                                 anew: backend="decode" made one)
        assert eager._HOT is hot
        out, lse = ak.attention(q, k, v, return_lse=True)
        out_r, lse_r = ak.attention(q.double(), k.double(), v.double(), backend="reference",
                                    return_lse=True)
        torch.testing.assert_close(lse.double(), lse_r, rtol=1e-5, atol=1e-6)
        k_nan = k.clone()
        k_nan[0, 1, 7, 3] = math.nan                    # the full path's screens: NaN rows
        got = ak.attention(q, k_nan, v)
        assert torch.isnan(got[0, 4:]).all() and torch.isfinite(got[0, :4]).all()


def test_a_jit_trace_after_a_warm_decode_frame_records_the_keyed_operator():
    """torch.jit.trace of a function calling attention() once its frame is hot: the hot
    frame (attend_slot, whose int status a trace cannot record) stays out of the trace, and
    the traced function answers as the reference."""
    if not native.available():
        pytest.skip("native kernel unavailable")
    q, k, v = _decode_qkv()
    with torch.no_grad():
        _warm(lambda: ak.attention(q, k, v))
        assert eager._HOT is not None
        traced = torch.jit.trace(lambda q, k, v: ak.attention(q, k, v), (q, k, v),
                                 check_trace=False)
        want = ak.attention(q.double(), k.double(), v.double(), backend="reference")
        torch.testing.assert_close(traced(q, k, v).double(), want, rtol=1e-5, atol=1e-6)
        assert "attend_slot" not in str(traced.graph)


def test_attend_slot_checks_the_signature_and_the_gradients():
    """``attend_slot`` runs ``attend_lean`` (bit for bit) only for tensors of its signature
    tensors' sizes and dtypes, on the CPU, and declines (status 1, nothing computed) a call
    whose inputs need gradients under grad mode; a non-finite output is status 2."""
    if not native.available():
        pytest.skip("native kernel unavailable")
    ops = native.loader.load()
    q, k, v = _decode_qkv()
    sigs = [torch.empty((), dtype=t.dtype).expand(t.shape) for t in (q, k, v)]
    inf = math.inf
    tail = (0.125, 0.0, -inf, inf, 1, 1, False)
    out, lse, status = ops.attend_slot(q, k, v, *sigs, *tail)
    want = ops.attend_lean(q, k, v, 0.125, 0.0, -inf, inf, None, 1, 1, False)
    assert status == 0 and torch.equal(out, want[0]) and torch.equal(lse, want[1])
    strided = torch.randn(1, 2, 192, 128)[..., ::2]
    assert ops.attend_slot(q, strided, v, *sigs, *tail)[2] == 0
    for args in ((q, k[:, :, 1:], v[:, :, 1:]), (q.double(), k, v), (q, k, v.double()),
                 (q[:, :4], k, v)):
        assert ops.attend_slot(*args, *sigs, *tail)[2] == 1
    for i in range(3):
        args = [t.clone().requires_grad_(j == i) for j, t in enumerate((q, k, v))]
        assert ops.attend_slot(*args, *sigs, *tail)[2] == 1
        with torch.no_grad():
            assert ops.attend_slot(*args, *sigs, *tail)[2] == 0
    v_bad = v.clone()
    v_bad[0, 0, 3, 3] = inf
    assert ops.attend_slot(q, k, v_bad, *sigs, *tail)[2] == 2


def test_attentions_inline_lane_check_reads_every_field_of_the_lane_state():
    """attnkit.attention's hot frame compares eager._lane_state's fields by position (0..6)
    and loader.hot_state's three: a new field there must be read there too (this fails
    first, pointing at api.attention's inline copy of eager._lane_holds)."""
    from attnkit.backends.native import loader

    assert len(eager._lane_state("auto")) == 7, "update api.attention's hot-frame check"
    assert len(loader.hot_state()) == 3, "update api.attention's hot-frame check"
