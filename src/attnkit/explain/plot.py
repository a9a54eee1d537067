"""The plot renderer: heatmaps of a trace as a PNG — the weights per head (and optionally
scores / scaled / logits), one panel per head.

matplotlib is imported only when a plot is made (``pip install 'attnkit[plot]'``); the Agg
renderer is used directly, so no display and no pyplot state are involved. Words come from
:mod:`.strings`, labels, heads and the downsampling from :mod:`.common`.

Shape legend::

    weights, scores, logits (n_q, n_k) per head → one panel each; rows = queries, columns = keys

Caution
-------
- Size: a panel draws at most 256 × 256 cells (:data:`~attnkit.explain.common.PLOT_GRID`);
  a larger matrix is downsampled into blocks (each pixel the mean of its block, a block that
  is all masked stays grey) and the figure says so. At most 8 heads are drawn
  (:data:`~attnkit.explain.common.MAX_HEADS`); the figure names the rest.
- Hangul (``lang="ko"`` or Korean word labels) needs a font with Hangul (Debian/Ubuntu:
  ``sudo apt install fonts-noto-cjk``; or fonts-nanum; Windows and macOS ship one). Without
  one, the titles fall back to English and one warning says why and how to install one.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .._outfiles import savefig_kwargs
from .common import (
    MAX_HEADS,
    PLOT_GRID,
    axis_labels,
    n_matrices,
    pool,
    shape_str,
    split_heads,
)
from .strings import STRINGS, check_lang

if TYPE_CHECKING:
    from .trace import Trace

__all__ = ["render_plot", "cjk_font", "korean_font", "short_value", "WHAT", "MAX_HEADS"]

WHAT = ("scores", "scaled", "logits", "weights")

# Families with Hangul, the course's first: Korean ones, then CJK sets that carry Hangul too
# (Linux: fonts-noto-cjk, fonts-nanum, fonts-unfonts-core, fonts-baekmuk; Windows: Malgun
# Gothic; macOS: Apple SD Gothic Neo, AppleGothic).
CJK_FAMILIES = ("Noto Sans CJK KR", "Noto Sans KR", "Source Han Sans K", "Source Han Sans KR",
                "NanumGothic", "NanumBarunGothic", "Malgun Gothic", "Apple SD Gothic Neo",
                "AppleGothic", "UnDotum", "Baekmuk Gulim", "Noto Sans CJK JP",
                "Noto Sans CJK SC", "Noto Sans CJK TC", "Droid Sans Fallback")
_HANGUL = re.compile("[\u1100-\u11ff\u3130-\u318f\uac00-\ud7af]")
NO_FONT = ("no font with Hangul found, so the {what} fall back to English: install one "
           "(Debian/Ubuntu: sudo apt install fonts-noto-cjk) and run again")


def _has_hangul(entry: object) -> bool:
    """Whether the font file of a font_manager entry really draws Hangul (가, 한)."""
    from matplotlib import ft2font

    try:
        try:                            # matplotlib >= 3.11 opens a face of a collection
            font = ft2font.FT2Font(entry.fname, face_index=getattr(entry, "index", 0))
        except TypeError:
            font = ft2font.FT2Font(entry.fname)
        return all(font.get_char_index(ord(c)) for c in "가한")
    except Exception:   # noqa: BLE001 - an unreadable font is just not a candidate
        return False


def _pick(ttflist: list) -> str | None:
    """The first family of CJK_FAMILIES present with a regular face that has Hangul."""
    by_name: dict[str, list] = {}
    for f in ttflist:
        by_name.setdefault(f.name, []).append(f)
    for fam in CJK_FAMILIES:
        faces = sorted(by_name.get(fam, []), key=lambda f: (f.style != "normal",
                                                             abs(_weight(f.weight) - 400)))
        if faces and faces[0].style == "normal" and _weight(faces[0].weight) == 400 \
                and _has_hangul(faces[0]):
            return fam
    return None


def _weight(w: object) -> int:
    from matplotlib.font_manager import weight_dict

    return w if isinstance(w, int) else weight_dict.get(str(w), 400)


@lru_cache(maxsize=1)
def cjk_font() -> str | None:
    """The family of an installed font with Hangul, or None.

    As matplotlib users do: look through ``font_manager.fontManager.ttflist`` for a family
    of :data:`CJK_FAMILIES` whose regular face has Hangul glyphs. matplotlib's font list is
    a cache, so a font installed after it was built is missing from it: then the system's
    font files that the list does not hold yet are added (every face and weight, so no
    ``findfont: Failed to find font weight`` follows) and the list is searched again."""
    from matplotlib import font_manager

    found = _pick(font_manager.fontManager.ttflist)
    if found:
        return found
    known = {f.fname for f in font_manager.fontManager.ttflist}
    for path in sorted(set(font_manager.findSystemFonts()) - known):
        try:
            font_manager.fontManager.addfont(path)
        except Exception:   # noqa: BLE001 - an unreadable font is just skipped
            continue
    return _pick(font_manager.fontManager.ttflist)


def korean_font(what: str) -> str | None:
    """:func:`cjk_font`, warning (once per figure) that ``what`` falls back to English
    when there is none."""
    font = cjk_font()
    if font is None:
        warnings.warn(NO_FONT.format(what=what), stacklevel=3)
    return font


def short_value(v: float) -> str:
    """A cell annotation: −∞, an integer, ≈0 for a tiny weight, else two decimals (three
    significant digits from 10⁴ on)."""
    if np.isneginf(v):
        return "−∞"
    if not np.isfinite(v):
        return "nan" if np.isnan(v) else "∞"
    if v == round(v) and abs(v) < 1e4:
        return str(int(v))
    if 0 < abs(v) < 0.005:
        return "≈0"
    if abs(v) >= 1e4:
        return f"{v:.2g}"
    return f"{v:.2f}"


def render_plot(traces: Trace | Sequence[Trace], path: str | Path,
                what: str | Sequence[str] = ("weights",), lang: str = "en") -> Path:
    """Write a PNG: one row of panels per (trace, quantity), one panel per head."""
    check_lang(lang)
    if not isinstance(traces, Sequence):
        traces = [traces]
    if isinstance(what, str):                   # what="weights": one quantity, not letters
        what = (what,)
    bad = [w for w in what if w not in WHAT]
    if bad or not what:
        raise ValueError(f"what must name some of {', '.join(WHAT)}, got {list(what)}")
    try:
        from matplotlib import colormaps
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(f"Trace.plot() needs matplotlib, which is not importable here ({e}): "
                          'pip install "attnkit[plot]"') from None

    texts = [tr.title.get(lang, "") for tr in traces] + [
        lab for tr in traces for lab in (tr.q_labels or []) + (tr.k_labels or [])]
    needs_cjk = lang == "ko" or any(_HANGUL.search(t) for t in texts)
    font = korean_font("heatmap titles") if needs_cjk else None
    if needs_cjk and font is None:
        lang = "en"
    family = ["DejaVu Sans", font] if font else ["DejaVu Sans"]
    t = STRINGS[lang]
    notes: list[str] = []

    n_heads = [max(min(n_matrices(tr.weights), MAX_HEADS), 1) for tr in traces]  # 0 heads: 1
    n_cols = min(max(n_heads), 4)
    grid = [-(-h // n_cols) for h in n_heads]          # rows of heads per quantity
    shapes = [tr.scores.shape[-2:] for tr in traces]
    pw = min(max(0.5 * max(n_k for _, n_k in shapes) + 1.3, 3.0), 4.5)
    heights = [min(max(0.5 * n_q + 1.4, 2.2), 4.5) * len(what) * g + 0.5
               for (n_q, _), g in zip(shapes, grid, strict=True)]
    fig = Figure(figsize=(max(pw * n_cols + 1.4, 6.0), sum(heights)), dpi=110,
                 layout="constrained")
    import matplotlib as mpl
    from matplotlib.colors import Normalize

    with mpl.rc_context({"font.family": family}), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Glyph .* missing")
        subs = fig.subfigures(len(traces), 1, squeeze=False, height_ratios=heights)[:, 0]
        for sf, tr, g in zip(subs, traces, grid, strict=True):
            title = tr.title.get(lang) or tr.title.get("en") or ""
            if title:
                sf.suptitle(title, fontsize=11, fontweight="bold")
            axes = sf.subplots(len(what) * g, n_cols, squeeze=False)
            n_q, n_k = tr.scores.shape[-2:]
            ql, kl = axis_labels(tr.q_labels, n_q, "q"), axis_labels(tr.k_labels, n_k, "k")
            if n_matrices(tr.weights) > MAX_HEADS:
                notes.append(t["plot_more_heads"].format(m=MAX_HEADS, n=n_matrices(tr.weights)))
            for r, w in enumerate(what):
                mats = split_heads(getattr(tr, w), lang, limit=MAX_HEADS)
                if w == "weights":
                    cmap, norm = colormaps["Blues"], Normalize(0.0, 1.0)
                else:
                    fin = np.concatenate([m[np.isfinite(m)] for _, m in mats] + [np.zeros(1)])
                    lim = float(np.abs(fin).max()) or 1.0
                    cmap, norm = colormaps["RdBu_r"], Normalize(-lim, lim)
                cmap = cmap.with_extremes(bad="#c9ccd3")
                im = None
                row_axes = [ax for gr in range(g) for ax in axes[r * g + gr]]
                for c, ax in enumerate(row_axes):
                    if c >= len(mats):
                        ax.axis("off")
                        if not mats:            # no heads (or no batch): say so, draw nothing
                            ax.text(0.5, 0.5, f"{t['plot_' + w]}\n"
                                    f"{shape_str(getattr(tr, w).shape)}", ha="center",
                                    va="center", fontsize=9, transform=ax.transAxes)
                        continue
                    label, m = mats[c]
                    if m.size == 0:             # n_q or n_k is 0: nothing to draw
                        ax.set_axis_off()
                        ax.text(0.5, 0.5, f"{t['plot_' + w]}\n({n_q}, {n_k})", ha="center",
                                va="center", fontsize=9, transform=ax.transAxes)
                        continue
                    m, fr, fc = pool(m, PLOT_GRID, PLOT_GRID)     # (≤ 256, ≤ 256) blocks
                    if fr * fc > 1:
                        notes.append(t["plot_pooled"].format(br=fr, bc=fc))
                    im = ax.imshow(np.ma.masked_invalid(m), cmap=cmap, norm=norm)
                    step = max(1, -(-max(n_q, n_k) // 12))
                    ax.set_xticks([(j + 0.5) / fc - 0.5 for j in range(0, n_k, step)],
                                  kl[::step], fontsize=8,
                                  rotation=45 if max(map(len, kl), default=0) > 3 else 0)
                    ax.set_yticks([(i + 0.5) / fr - 0.5 for i in range(0, n_q, step)],
                                  ql[::step], fontsize=8)
                    ax.set_xlabel(t["keys"], fontsize=8)
                    if c % n_cols == 0:
                        ax.set_ylabel(t["queries"], fontsize=8)
                    ax.set_title((f"{label}: " if label else "") + t["plot_" + w], fontsize=9)
                    if n_q * n_k <= 64:
                        for i in range(n_q):
                            for j in range(n_k):
                                v = float(m[i, j])
                                rgb = cmap(norm(v))[:3] if np.isfinite(v) else (0.8,) * 3
                                lum = 0.3 * rgb[0] + 0.59 * rgb[1] + 0.11 * rgb[2]
                                ax.text(j, i, short_value(v), ha="center", va="center", fontsize=8,
                                        color="white" if lum < 0.5 else "#1d2330")
                if im is not None:
                    sf.colorbar(im, ax=row_axes, shrink=0.8)
        if "logits" in what and any(np.isneginf(tr.logits).any() for tr in traces):
            fig.text(0.99, 0.002, t["plot_masked"], ha="right", va="bottom", fontsize=7,
                     color="#5b6475")
        if notes:                       # downsampled / heads left out (the layout makes room)
            fig.supxlabel("   ".join(dict.fromkeys(notes)), x=0.01, ha="left", fontsize=7,
                          color="#5b6475")
        out = Path(path)
        fig.savefig(out, format="png", **savefig_kwargs(out, "png"))
    return out
