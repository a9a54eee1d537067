"""The built-in lessons: why ÷√d_k measured, scaling vs QK-Norm vs soft-cap, attention vs FFN,
the multi-head split — each in English and Korean, and on the command line."""

from __future__ import annotations

import math

import pytest

from attnkit.cli import main
from attnkit.explain.lessons import D_KS, LESSONS, measure_sqrt_dk


def test_sqrt_dk_measures_what_the_derivation_says():
    rows = measure_sqrt_dk(trials=2000, n_keys=16, seed=0)
    assert [r["d_k"] for r in rows] == list(D_KS)
    for r in rows:
        d = r["d_k"]
        assert abs(r["var"] / d - 1) < 0.1                     # Var(q·k) ≈ d_k
        assert abs(r["var_scaled"] - 1) < 0.1                  # Var(q·k/√d_k) ≈ 1
        assert abs(r["pmax_scaled"] - rows[0]["pmax_scaled"]) < 0.03   # flat with scaling
        assert r["entropy_scaled"] < math.log(16)
    raw_p = [r["pmax_raw"] for r in rows]
    raw_slope = [r["slope_raw"] for r in rows]
    assert raw_p == sorted(raw_p) and raw_p[-1] > 0.95         # unscaled: towards one-hot
    assert raw_slope == sorted(raw_slope, reverse=True) and raw_slope[-1] < 0.03
    assert measure_sqrt_dk(trials=50) == measure_sqrt_dk(trials=50)     # seeded


@pytest.mark.parametrize("name", list(LESSONS))
@pytest.mark.parametrize("lang", ["en", "ko"])
def test_every_lesson_prints(name, lang):
    text = LESSONS[name].text(lang)
    assert len(text.splitlines()) > 8
    assert "Traceback" not in text


def test_lesson_contents():
    en = LESSONS["sqrt-dk"].text("en")
    assert "Var(q·k) = d_k" in en and "initialisation only" in en and "QK-Norm" in en
    ko = LESSONS["sqrt-dk"].text("ko")
    assert "분산" in ko and "초기화 때만" in ko
    bounds = LESSONS["bounds"].text("en")
    assert "50·tanh(a/50)" in bounds and "-50.000" in bounds and "before the dot product" in bounds
    ffn = LESSONS["attn-vs-ffn"].text("en")
    assert "4d² = 1,048,576" in ffn and "8d² = 2,097,152" in ffn and "1.00" in ffn
    heads = LESSONS["heads"].text("en")
    assert "head 2: columns d5–d8" in heads and "Head 2 is d5–d8, not d1–d4" in heads


def test_cli_lesson_and_plot(tmp_path, capsys):
    png = tmp_path / "sqrt.png"
    assert main(["lesson", "sqrt-dk", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "Var(q·k/√d_k)" in out and png.stat().st_size > 10_000
    assert main(["lesson", "bounds", "--plot", str(tmp_path / "x.png")]) == 2
    assert "has no figure" in capsys.readouterr().err
    assert main(["lesson", "nope"]) == 2
    capsys.readouterr()
    assert main(["lesson"]) == 0
    assert [ln.split()[0] for ln in capsys.readouterr().out.splitlines()] == list(LESSONS)
