"""The text walkthrough: number formatting, matrices, the step table, remarks, colour, Korean."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch

import attnkit as ak
from attnkit.explain.common import fmt
from attnkit.explain.remarks import remarks
from attnkit.explain.strings import STRINGS
from attnkit.explain.text import (
    display_width,
    format_matrix,
    render_text,
    step_table,
    use_color,
)
from helpers.textparse import parse


@pytest.mark.parametrize(("x", "s"), [
    (0.50612, "0.506"), (0.99966, "0.9997"), (4.54e-5, "0.00005"), (1.12e-7, "1.1e-07"),
    (0.0, "0"), (-math.inf, "-inf"), (16.0, "16.000"), (1.0, "1.000"),
    (0.9999999999999, "1.000"), (-0.25, "-0.250"), (float("nan"), "nan"),
])
def test_fmt_keeps_what_rounding_would_hide(x, s):
    assert fmt(x) == s


def test_format_matrix_labels_and_sums():
    a = np.array([[0.25, 0.75], [1.0, 0.0]])
    text = format_matrix(a, rows=["I", "go"], cols="k", sums=a.sum(-1), sum_label="Σ")
    lines = text.splitlines()
    assert lines[0].split() == ["k1", "k2", "|", "Σ"]
    assert lines[1].split() == ["I", "0.250", "0.750", "|", "1.000"]
    assert lines[2].split() == ["go", "1.000", "0", "|", "1.000"]


def test_format_matrix_prints_whole_numbers_as_integers():
    text = format_matrix(np.array([[2.0, 0.0, -1.0]]))
    assert text.splitlines()[1].split() == ["q1", "2", "0", "-1"]


def test_format_matrix_summarises_large_matrices():
    a = np.arange(30 * 64, dtype=float).reshape(30, 64) / 7
    lines = format_matrix(a).splitlines()
    assert len(lines) == 1 + 12                        # header + 12 shown rows (one is ⋮)
    assert "…" in lines[0] and "k64" in lines[0] and "k10" not in lines[0]
    assert any(line.strip().startswith("⋮") for line in lines)
    assert lines[-1].split()[0] == "q30"
    assert lines[-1].split()[-1] == fmt(a[29, 63])


def test_hangul_labels_are_aligned_by_display_width():
    assert display_width("학교에") == 6 and display_width("go") == 2
    text = format_matrix(np.eye(2) * 0.5, rows=["학교에", "go"], cols=["나는", "x"])
    # every line (header and rows) ends in the same terminal column
    assert len({display_width(line) for line in text.splitlines()}) == 1
    assert text.splitlines()[1].split()[0] == "학교에"


def _trace(**kw):
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
    return ak.explain(q, k, v, **kw)


def test_step_table_has_the_five_steps_with_formula_and_shape():
    table = step_table(_trace()).splitlines()
    assert table[0].split(" | ")[0].strip() == "step"
    body = [line.split(" | ") for line in table[2:]]
    assert [c[0].split(". ")[1].strip() for c in body] == [
        "MatMul", "Scale", "Mask", "Softmax", "MatMul"]
    assert body[0][2].strip() == "S = Q Kᵀ" and body[4][2].strip() == "O = W V"
    assert body[0][3].strip() == "(n_q, n_k) = (3, 2)"
    assert body[4][3].strip() == "(n_q, d_v) = (3, 3)"


def test_walkthrough_numbers_match_the_trace():
    tr = _trace(is_causal=True)
    (sec,) = parse(tr.to_text())
    np.testing.assert_allclose(sec.values("4"), tr.weights, atol=5e-4)
    np.testing.assert_allclose(sec.values("5"), tr.output, atol=5e-4)
    assert sec.values("3")[0][1] == -math.inf
    assert sec.steps["4"].matrix.sums == [1.0, 1.0, 1.0]


def test_remark_for_a_query_that_sees_no_key():
    mask = torch.tensor([[False, False], [True, True], [True, False]])
    tr = _trace(mask=mask)
    notes = remarks(tr)
    assert any("q1 may see no key" in n for n in notes)
    (sec,) = parse(tr.to_text())
    assert sec.values("4")[0] == [0.0, 0.0] and sec.values("5")[0] == [0.0, 0.0, 0.0]


def test_remark_for_queries_and_keys_of_different_lengths():
    assert any("n_q = 3 queries but n_k = 2 keys" in n for n in remarks(_trace()))


def test_no_saturation_remark_for_soft_weights():
    assert not any("saturated" in n for n in remarks(_trace()))
    hot = remarks(_trace(scale=20.0))
    assert any("saturated" in n for n in hot)


def test_colour_only_when_asked_or_on_a_terminal(monkeypatch):
    tr = _trace()
    assert "\033[" in tr.to_text(color=True)
    assert "\033[" not in tr.to_text(color=False)

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    assert use_color(None, Tty()) is True
    assert use_color(None, io.StringIO()) is False
    monkeypatch.setenv("NO_COLOR", "1")
    assert use_color(None, Tty()) is False
    # the coloured text still parses to the same numbers
    assert parse(tr.to_text(color=True))[0].values("4") == parse(tr.to_text())[0].values("4")


def test_korean_walkthrough():
    tr = _trace(is_causal=True)
    ko = tr.to_text(lang="ko")
    for s in ("단계", "하는 일", "수식", "모양", "4. Softmax", "입력", "눈여겨볼 점"):
        assert s in ko, s            # the course's terms in Latin script (issue 12, item 5)
    assert "소프트맥스" not in ko and "마스크" not in ko
    assert "what it does" not in ko
    assert parse(ko)[0].values("4") == parse(tr.to_text())[0].values("4")


def test_both_languages_have_every_string():
    assert STRINGS["en"].keys() == STRINGS["ko"].keys()
    for key, en in STRINGS["en"].items():
        assert STRINGS["ko"][key].count("{") == en.count("{"), key


def test_unknown_language_is_a_clear_error():
    with pytest.raises(ValueError, match="lang must be one of en, ko"):
        _trace().to_text(lang="fr")


def test_labels_must_match_the_rows():
    with pytest.raises(ValueError, match="q_labels has 2 labels but there are 3 queries"):
        _trace().labelled(["a", "b"], None)


def test_render_text_limits_heads():
    q = torch.randn(6, 3, 4, dtype=torch.float64)
    text = render_text(ak.explain(q, q, q), max_heads=2)
    (sec,) = parse(text)
    assert list(sec.steps["4"].heads) == ["head 1", "head 2"]
    assert "4 more heads" in text


@pytest.mark.parametrize(("n_q", "n_k"), [(2, 0), (0, 2)])
def test_empty_queries_or_keys_render(tmp_path, n_q, n_k):
    f = torch.float64
    tr = ak.explain(torch.ones(n_q, 4, dtype=f), torch.ones(n_k, 4, dtype=f),
                    torch.ones(n_k, 3, dtype=f))
    (sec,) = parse(tr.to_text())
    assert sec.steps["4"].shape == (n_q, n_k) and sec.steps["5"].shape == (n_q, 3)
    if n_q:
        assert sec.values("5") == [[0.0, 0.0, 0.0]] * n_q      # nothing to attend to: zeros
    assert "<table" in tr.to_html()
    assert tr.plot(tmp_path / "e.png").stat().st_size > 0
