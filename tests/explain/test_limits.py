"""explain at the edges: large traces are summarised in text, page and plot; above the limits,
and where finite inputs overflow, one clear ExplainError (English and Korean)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

import attnkit as ak
from attnkit.explain import ExplainError
from attnkit.explain import common as cm
from attnkit.explain import plot as plot_mod
from attnkit.explain.common import fmt, page_grid, pool
from attnkit.explain.examples import EXAMPLES
from attnkit.explain.guard import MAX_SCORES, MAX_VALUES
from attnkit.explain.html import render_html
from attnkit.explain.text import format_matrix


@pytest.fixture(scope="module")
def big() -> ak.Trace:
    x = np.random.default_rng(0).standard_normal((1000, 16))
    return ak.explain(x, x, x, is_causal=True)


# ---------------------------------------------------------------------------- summarised


def test_large_page_is_drawn_in_blocks_and_stays_small(big):
    for lang, note in (("en", "Too large to show cell by cell"), ("ko", "셀 하나하나 보여 주기")):
        page = big.to_html(lang=lang)
        assert len(page.encode()) < 2_000_000                  # was 198 MB
        assert note in page
    page = big.to_html()
    assert page.count("<td") < cm.PAGE_CELLS                  # was 5 million cells
    g = page_grid(big)
    assert g is not None
    m = re.search(r'data-key="weights">.*?<tbody>(.*?)</tbody>', page)
    rows = re.findall(r"<tr>(.*?)</tr>", m.group(1))
    assert len(rows) <= g
    f = -(-1000 // g)                                         # rows (and keys) per block
    assert f"each cell: the mean of a block of {f} × {f}" in page
    assert re.search(rf'<th class="r">q1–q{f}</th>', rows[0])
    first = re.findall(r'data-v="([^"]+)"', rows[0])[0]
    assert float(first) == pytest.approx(big.weights[:f, :f].mean(), abs=5e-4)


def test_small_traces_are_shown_cell_by_cell():
    for ex in EXAMPLES.values():
        for tr in ex.traces():
            assert page_grid(tr) is None, ex.name
    page = render_html(EXAMPLES["shapes"].traces())
    assert "Too large" not in page and "each cell: the mean" not in page


def test_large_text_prints_corners_with_a_note(big):
    en, ko = big.to_text(), big.to_text(lang="ko")
    assert len(en) < 20_000 and len(ko) < 20_000
    assert "1000 × 1000: showing a corner (the --html page shows it in blocks of means)" in en
    assert "1000 × 1000: 일부만 표시 (--html 페이지에는 블록 평균으로 줄여서 보여 줍니다)" in ko
    assert "q1000" in en and "q500" not in en


def test_pool_takes_block_means_and_keeps_masked_blocks():
    m = np.array([[1.0, 3.0, -np.inf], [5.0, 7.0, -np.inf], [np.nan, 0.0, 2.0]])
    p, fr, fc = pool(m, 2, 2)
    assert (fr, fc) == (2, 2) and p.shape == (2, 2)
    assert p[0, 0] == 4.0 and np.isneginf(p[0, 1])           # all masked stays masked
    assert p[1, 0] == 0.0 and p[1, 1] == 2.0                 # finite values win over NaN
    assert np.isnan(pool(np.full((4, 4), np.nan), 2, 2)[0]).all()
    same, fr, fc = pool(m, 3, 3)
    assert same is m and fr == fc == 1


def test_large_plot_is_downsampled(big, tmp_path, monkeypatch):
    shown = []

    def spy(m, rows, cols):  # noqa: ANN001, ANN202
        out = pool(m, rows, cols)
        shown.append(out[0].shape)
        return out

    monkeypatch.setattr(plot_mod, "pool", spy)
    out = big.plot(tmp_path / "big.png", what=("logits", "weights"))
    assert out.stat().st_size > 0
    assert shown and all(max(s) <= cm.PLOT_GRID for s in shown)


def test_many_heads_are_capped_and_named(tmp_path):
    q = torch.randn(12, 3, 4, dtype=torch.float64)
    tr = ak.explain(q, q, q)
    page = tr.to_html()
    assert page.count('<button type="button" data-head=') == cm.MAX_HEADS
    assert "… 4 more heads are not shown: the page shows the first 8" in page
    assert "head 4개 더 있음" in tr.to_html(lang="ko")
    assert tr.plot(tmp_path / "h.png").stat().st_size > 0


def test_no_batch_renders_everywhere(tmp_path):
    x = torch.ones(0, 2, 3, 4, dtype=torch.float64)
    tr = ak.explain(x, x, x)
    assert tr.to_text() and tr.to_html()
    assert tr.plot(tmp_path / "none.png").stat().st_size > 0   # was ZeroDivisionError


# ---------------------------------------------------------------------------- refused


def test_above_the_limit_explain_refuses_before_computing():
    n = math.isqrt(MAX_SCORES) + 1
    q = torch.zeros(n, 1)
    with pytest.raises(ExplainError, match=r"4,196,352 scores \(batch·heads·n_q·n_k = "
                                           r"1·1·2049·2048\), more than the limit of 4,194,304"
                       ) as e:
        ak.explain(q, q[:-1], q[:-1])
    assert isinstance(e.value, ValueError)
    assert "한도 4,194,304개를 넘습니다" in e.value.message("ko")
    with pytest.raises(ExplainError, match="first 1024 queries and keys"):
        ak.explain(torch.zeros(4, 1025, 1), torch.zeros(4, 1025, 1), torch.zeros(4, 1025, 1))
    wide = torch.zeros(1, MAX_VALUES + 1, dtype=torch.float16)
    with pytest.raises(ExplainError, match=r"q \(1, 16777217\) has 16,777,217 values"):
        ak.explain(wide, wide, wide)


def test_overflow_in_the_scores_is_named():
    x = np.full((2, 2), 1e308)
    with pytest.raises(ExplainError, match=r"Q·Kᵀ overflows float64 at query q1, key k1: .*"
                                           r"1\.000e\+308 and 1\.000e\+308"):
        ak.explain(x, x, x)
    f = torch.ones(2, 3, 4, dtype=torch.float32)
    f[1, 1] = 1e20                                             # head 2, query 2
    with pytest.raises(ExplainError, match="overflows float32 at query q2, key k1, head 2"):
        ak.explain(f, torch.ones(2, 3, 4) * 1e19, torch.ones(2, 3, 4))
    with pytest.raises(ExplainError) as e:
        ak.explain(x, x, x)
    assert e.value.message("ko").startswith("Q·Kᵀ가 float64 범위를 넘칩니다 (Query q1, Key k1)")


def test_overflow_of_the_scale_and_of_a_score_mod_is_named():
    x = torch.full((2, 4), 5.0, dtype=torch.float64)          # S = 100
    with pytest.raises(ExplainError, match=r"S · scale overflows float64 at query q1, key k1: "
                                           r"S = 100\.000 and scale = 1\.000e\+307"):
        ak.explain(x, x, x, scale=1e307)

    def boost(s, b, h, q, k):  # noqa: ANN001, ANN202
        return torch.where(q == k, torch.inf, s)

    with pytest.raises(ExplainError, match=r"X at query q1, key k1 is inf .* the score_mod"):
        ak.explain(x, x, x, score_mod=boost)


def test_nan_and_inf_inputs_still_show_and_render():
    q = torch.randn(3, 4, dtype=torch.float64)
    q[1, 0] = math.nan
    tr = ak.explain(q, q.nan_to_num(), q.nan_to_num())         # a NaN input is not overflow
    assert np.isnan(tr.output[1]).all()
    page = tr.to_html()                                       # was: ValueError in _hex
    assert 'data-v="nan"' in page
    assert "nan" in tr.to_text()


# ---------------------------------------------------------------------------- numbers


def test_huge_and_tiny_numbers_print_in_scientific_notation():
    assert fmt(1e308) == "1.000e+308" and fmt(-2.5e6) == "-2.500e+06"
    assert fmt(123456.5) == "123456.500" and fmt(1.12e-7) == "1.1e-07"
    text = format_matrix(np.array([[1e308, 1.0], [2.0, 3.0]]))
    assert max(len(w) for w in text.split()) < 12             # no 309-digit integers
    assert plot_mod.short_value(1e308) == "1e+308" and plot_mod.short_value(12345.6) == "1.2e+04"


def test_decimals_out_of_range_is_a_clear_error():
    tr = EXAMPLES["causal"].build()
    for bad in (-1, 13, 2.5, True):
        with pytest.raises(ExplainError, match="decimals must be a whole number from 0 to 12"):
            tr.to_text(decimals=bad)
    with pytest.raises(ExplainError, match="decimals"):
        render_html([tr], decimals=-1)
    assert tr.to_text(decimals=0) and tr.to_text(decimals=12)


def test_plot_accepts_one_quantity_as_a_string(tmp_path):
    tr = EXAMPLES["causal"].build()
    assert tr.plot(tmp_path / "w.png", what="logits").stat().st_size > 0   # was: 'l' unknown
    with pytest.raises(ValueError, match=r"got \['attention'\]"):
        tr.plot(tmp_path / "x.png", what="attention")
