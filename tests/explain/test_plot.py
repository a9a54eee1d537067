"""Heatmap PNGs: written, decodable, one panel per head, Hangul when a CJK font exists."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from PIL import Image

import attnkit as ak
from attnkit.explain import plot as plot_mod
from attnkit.explain.examples import EXAMPLES


def pixels(path) -> np.ndarray:  # noqa: ANN001
    with Image.open(path) as img:
        assert img.format == "PNG"
        return np.asarray(img.convert("RGB"), dtype=float)


def test_trace_plot_writes_a_decodable_png(tmp_path):
    tr = EXAMPLES["causal"].build()
    out = tr.plot(tmp_path / "w.png")
    assert out == tmp_path / "w.png"
    img = pixels(out)
    assert img.shape[0] > 200 and img.shape[1] > 300
    # the weights heatmap has colour: the dark blue of the 0.844 cell is somewhere
    assert (img[..., 2] - img[..., 0] > 80).any()


def test_more_quantities_and_heads_make_a_bigger_figure(tmp_path):
    q = torch.randn(4, 3, 4, dtype=torch.float64)
    tr = ak.explain(q, q, q, is_causal=True)
    one = pixels(tr.plot(tmp_path / "one.png"))
    two = pixels(tr.plot(tmp_path / "two.png", what=("logits", "weights")))
    assert two.shape[0] > 1.6 * one.shape[0]
    single = pixels(EXAMPLES["causal"].build().plot(tmp_path / "single.png"))
    assert one.shape[1] > 1.5 * single.shape[1]          # 4 heads side by side


def test_unknown_quantity_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="what must name some of scores, scaled, logits, weights"):
        EXAMPLES["causal"].build().plot(tmp_path / "x.png", what=("attention",))


def test_korean_plot_uses_a_cjk_font_or_falls_back_with_a_warning(tmp_path):
    traces = EXAMPLES["cross"].traces()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = plot_mod.render_plot(traces, tmp_path / "ko.png", lang="ko")
    assert pixels(out).size
    messages = [str(w.message) for w in caught]
    assert not any("Glyph" in m for m in messages)       # no missing-glyph boxes
    if plot_mod.cjk_font() is None:
        assert any("no font with Hangul" in m for m in messages)
    else:
        assert not any("no font with Hangul" in m for m in messages)


def test_cjk_font_is_installed_where_ci_installs_it():
    from pathlib import Path

    if not any(Path("/usr/share/fonts").rglob("*CJK*")) and not any(
            Path("/usr/share/fonts").rglob("*Nanum*")):
        pytest.skip("no CJK font installed (.ci/setup-system installs fonts-noto-cjk)")
    assert plot_mod.cjk_font() is not None


def test_plot_without_matplotlib_names_the_extra(monkeypatch):
    """``tr.plot()`` without matplotlib: one ImportError with the exact install command (was a
    raw ModuleNotFoundError)."""
    import sys

    tr = ak.explain(torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 2))
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r'pip install "attnkit\[plot\]"'):
        tr.plot("unused.png")


def test_png_and_page_use_the_same_colour_scale():
    """Positive scores red and negative blue in both (RdBu_r in the PNG, the page's own mix
    towards RdBu_r's ends), weights white → dark blue in both (Blues); darker with |v|."""
    from matplotlib import colormaps

    from attnkit.explain.html import cell_color

    def rgb(hex_: str) -> np.ndarray:
        return np.array([int(hex_[i:i + 2], 16) / 255 for i in (1, 3, 5)])

    rdbu, blues = colormaps["RdBu_r"], colormaps["Blues"]
    for v in (-1.0, -0.6, -0.2, 0.2, 0.6, 1.0):
        page = rgb(cell_color(v, "value", 1.0)[0])
        png = np.array(rdbu((v + 1) / 2)[:3])
        for c in (page, png):
            assert (c[0] > c[2]) == (v > 0), (v, page, png)     # red above 0, blue below
        assert np.abs(page - png).max() < 0.35, (v, page, png)
    dark = [rgb(cell_color(w, "weights", 1.0)[0]).sum() for w in (0.0, 0.3, 0.7, 1.0)]
    assert dark == sorted(dark, reverse=True)
    for w in (0.3, 0.7, 1.0):
        page, png = rgb(cell_color(w, "weights", 1.0)[0]), np.array(blues(w)[:3])
        assert page.argmax() == png.argmax() == 2 and np.abs(page - png).max() < 0.3, (w, page, png)
