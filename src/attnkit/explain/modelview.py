"""The renderers of a :class:`~attnkit.explain.model.ModelTrace`: text, HTML and PNG.

Each shows the same two things: the grid of every layer × head (text: where the chosen
query looks in each head; page and PNG: every head's weights over the tokens), and the
five steps of one head for one query token with the model's own numbers — raw q·k,
× scale (1/√d_h), the mask from padding, softmax, and the mixing o = Σ_j w_j v_j.

Shape legend::

    weights (L, H, n, n)   one head (n, n)   one query's row (n,)   its output o (d_v,)

The page ends with the chosen head's full matrices and, for a text of at most 16 tokens, the
playground of :mod:`.live` on that head's real Q, K, V (d_h wide rows drawn as strips).

Caution
-------
- The page draws every head as a small SVG (L·H·n² rectangles): at 6 × 12 heads and 14
  tokens about 14,000, some 1 MB. Above :data:`GRID_TOKENS` tokens the grid cells are the
  block means of :func:`~attnkit.explain.common.pool` (the page says so).
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .._outfiles import GENERATOR_META, savefig_kwargs
from .common import fmt, pool
from .strings import STRINGS, check_lang
from .text import display_width

if TYPE_CHECKING:
    from .model import ModelTrace

__all__ = ["model_text", "model_html", "model_plot", "GRID_TOKENS"]

GRID_TOKENS = 48
MIX_SHOWN = 8
E = html.escape


def _rj(s: str, w: int) -> str:
    return " " * max(w - display_width(s), 0) + s


def _lj(s: str, w: int) -> str:
    return s + " " * max(w - display_width(s), 0)


def _q(tok: str) -> str:
    return f"'{tok}'"


def _strongest_line(mt: ModelTrace, lang: str) -> str | None:
    """For the pronoun sentence: where 'it' looks at 'animal' most."""
    low = [t.lower() for t in mt.tokens]
    if "it" not in low or "animal" not in low:
        return None
    it, animal = low.index("it") + 1, low.index("animal") + 1
    layer, head, w = mt.strongest(it, animal)
    return STRINGS[lang]["m_strongest"].format(a=_q("it"), b=_q("animal"), l=layer, h=head,
                                               w=fmt(w))


def _note(mt: ModelTrace, lang: str) -> str | None:
    """The model's warning about its text (Korean in an English-only model), in ``lang``."""
    return mt.notes.get(lang) or mt.notes.get("en")


def _top(weights: np.ndarray, labels: list[str], k: int = 3) -> str:
    order = np.argsort(-weights, kind="stable")[:k]
    return ", ".join(f"{labels[j]} {fmt(float(weights[j]))}" for j in order)


def model_text(mt: ModelTrace, lang: str, layer: int, head: int, token: int,
               decimals: int = 3) -> str:
    """The grid (where the query looks in each head) and the chosen head's five steps."""
    t = check_lang(lang)
    lab = mt.labels()
    out = [t["m_title"].format(model=mt.model), "=" * 60,
           t["m_about"].format(layers=mt.n_layers, heads=mt.n_heads, d=mt.d_model,
                               dh=mt.d_head),
           f"{t['m_text']}: {mt.text}",
           f"{t['m_tokens'].format(n=len(mt.tokens))}: "
           + "  ".join(f"{i + 1}:{tok}" for i, tok in enumerate(mt.tokens))]
    note = _note(mt, lang)
    if note:                          # the model cannot read this text: said first, once
        out[2:2] = [note, ""]
    if mt.n_real < len(mt.tokens):
        out.append(t["m_padding"].format(p=len(mt.tokens) - mt.n_real))
    line = _strongest_line(mt, lang)
    if line:
        out.append(line)
    w = mt.weights                                                   # (L, H, n, n)
    out += ["", t["m_grid"].format(tok=_q(lab[token - 1]))]
    width = 11
    head_word = t["head"]
    lw = max(display_width(f"{t['m_layer']} {mt.n_layers}"), 7) + 2
    out.append(" " * lw + "".join(_rj(f"{head_word} {h + 1}", width)
                                  for h in range(mt.n_heads)))
    for li in range(mt.n_layers):
        cells = []
        for h in range(mt.n_heads):
            row = w[li, h, token - 1]                                # (n,)
            j = int(np.argmax(row))
            star = "*" if (li + 1, h + 1) == (layer, head) else " "
            w2 = f"{float(row[j]):.2f}".lstrip("0")                  # ".41", "1.00"
            cells.append(_rj(f"{star}{lab[j][:6]} {w2}", width))
        out.append(_lj(f"{t['m_layer']} {li + 1}", lw) + "".join(cells))
    out += ["", _focus_text(mt, lang, layer, head, token, decimals)]
    return "\n".join(out) + "\n"


def _focus_text(mt: ModelTrace, lang: str, layer: int, head: int, token: int,
                decimals: int) -> str:
    t = STRINGS[lang]
    lab = mt.labels()
    st = mt.steps(layer, head, token)
    tr = mt.layers[layer - 1]
    out = [t["m_focus"].format(l=layer, h=head, tok=_q(lab[token - 1])),
           t["m_scale"].format(scale=fmt(tr.scale, decimals), dh=mt.d_head)]
    kw = max(display_width(x) for x in lab + [t["m_key"]]) + 2
    cols = [t["m_s"], t["m_x"], t["m_m"], t["m_w"]]
    out.append(_lj(t["m_key"], kw) + "".join(_rj(c, 12) for c in cols))
    for j, name in enumerate(lab):
        vals = [st["scores"][j], st["scaled"][j], st["mask"][j], st["weights"][j]]
        bar = "█" * int(round(20 * float(st["weights"][j])))
        out.append(_lj(name, kw) + "".join(fmt(float(x), decimals).rjust(12) for x in vals)
                   + "  " + bar)
    out.append(t["m_sum"].format(s=fmt(float(st["weights"].sum()), decimals)))
    out.append(t["m_top"].format(items=_top(st["weights"], lab)))
    o = st["output"]
    out.append(t["m_mix"].format(dv=o.shape[-1], m=min(MIX_SHOWN, o.shape[-1])))
    out.append("  o = [" + ", ".join(fmt(float(x), decimals) for x in o[:MIX_SHOWN])
               + (", …]" if o.shape[-1] > MIX_SHOWN else "]"))
    return "\n".join(out)


# ---------------------------------------------------------------------------- the page


def _mini_svg(m: np.ndarray, label: str, on: bool, key: str) -> str:
    """One head's weights as a small SVG heatmap (white → the weights' blue)."""
    from .html import cell_color

    n_q, n_k = m.shape
    c = 84 / max(n_q, n_k)
    rects = []
    for i in range(n_q):
        for j in range(n_k):
            bg = cell_color(float(m[i, j]), "weights", 1.0)[0]
            if bg != "#ffffff":
                rects.append(f'<rect x="{j * c:.2f}" y="{i * c:.2f}" width="{c:.2f}" '
                             f'height="{c:.2f}" fill="{bg}"/>')
    cls = "mini on" if on else "mini"
    return (f'<button type="button" class="{cls}" data-head="{key}" '
            f'aria-label="{E(label)}" title="{E(label)}"><svg viewBox="0 0 84 84" '
            f'preserveAspectRatio="xMinYMin meet"><rect width="84" height="84" fill="#fff" '
            f'stroke="#d9dee8"/>'
            f'{"".join(rects)}</svg></button>')


MODEL_CSS = """
.mgrid{margin:6px 0}
.mlayer{display:flex;align-items:flex-start;gap:6px;margin:0 0 6px}
.mlab{flex:0 0 auto;width:4.5em;font:12px system-ui,sans-serif;color:var(--mute);
 padding-top:16px}
.mheads{flex:1 1 0;min-width:0;display:grid;gap:2px;
 grid-template-columns:repeat(auto-fill,minmax(48px,1fr))}
.mcell{min-width:0;text-align:center;font:11px system-ui,sans-serif;color:var(--mute)}
.mcell span{display:block;white-space:nowrap;overflow:hidden;text-overflow:ellipsis}
button.mini{border:2px solid transparent;background:none;padding:0;cursor:pointer;
 border-radius:4px;line-height:0;width:100%;max-width:88px}
button.mini svg{width:100%;height:auto;display:block}
@media (max-width:600px){.mlab{width:auto;padding-top:0}.mlayer{display:block}}
button.mini.on{border-color:#b00020}
button.mini:focus-visible{outline:2px solid var(--acc)}
.mwrap{overflow-x:auto;max-width:100%}
table.mstep{border-collapse:collapse;font:13px ui-monospace,monospace}
table.mstep td,table.mstep th{padding:2px 8px;border-bottom:1px solid var(--line);
 text-align:right}
table.mstep td:first-child,table.mstep th:first-child{text-align:left}
.mwarn{background:#fff4e5;border:1px solid #f0b35a;border-radius:8px;padding:8px 12px;
 color:#5c3a00}
.bar{display:inline-block;height:10px;background:#08306b;vertical-align:middle}
"""

MODEL_JS = """
(function(){
  document.querySelectorAll('button.mini').forEach(function(b){
    b.addEventListener('click',function(){
      document.querySelectorAll('button.mini').forEach(function(x){x.classList.remove('on');});
      b.classList.add('on');
      document.querySelectorAll('.mfocus').forEach(function(p){
        p.hidden = p.getAttribute('data-head')!==b.getAttribute('data-head');});
    });
  });
})();
"""


def _focus_html(mt: ModelTrace, lang: str, layer: int, head: int, token: int,
                hidden: bool) -> str:
    t = STRINGS[lang]
    lab = mt.labels()
    st = mt.steps(layer, head, token)
    tr = mt.layers[layer - 1]
    rows = [f"<tr><th>{E(t['m_key'])}</th>" + "".join(
        f"<th>{E(t[c])}</th>" for c in ("m_s", "m_x", "m_m", "m_w")) + "<th></th></tr>"]
    for j, name in enumerate(lab):
        vals = [st["scores"][j], st["scaled"][j], st["mask"][j], st["weights"][j]]
        w = float(st["weights"][j])
        rows.append(f"<tr><td>{E(name)}</td>" + "".join(
            f'<td data-v="{fmt(float(x))}">{E(fmt(float(x)).replace("-inf", "−∞"))}</td>'
            for x in vals) + f'<td><span class="bar" style="width:{120 * w:.1f}px"></span>'
            "</td></tr>")
    o = st["output"]
    key = f"{layer}-{head}"
    return (f'<div class="mfocus" data-head="{key}"{" hidden" if hidden else ""}>'
            f"<h3>{E(t['m_focus'].format(l=layer, h=head, tok=_q(lab[token - 1])))}</h3>"
            f'<div class="legend">{E(t["m_scale"].format(scale=fmt(tr.scale), dh=mt.d_head))}'
            f'</div><div class="mwrap"><table class="mstep">{"".join(rows)}</table></div>'
            f'<p>{E(t["m_sum"].format(s=fmt(float(st["weights"].sum()))))} · '
            f'{E(t["m_top"].format(items=_top(st["weights"], lab)))}</p>'
            f'<p>{E(t["m_mix"].format(dv=o.shape[-1], m=min(MIX_SHOWN, o.shape[-1])))} '
            f'<code>o = [{", ".join(fmt(float(x)) for x in o[:MIX_SHOWN])}'
            f'{", …" if o.shape[-1] > MIX_SHOWN else ""}]</code></p></div>')


def model_html(mt: ModelTrace, lang: str, layer: int, head: int, token: int) -> str:
    """One self-contained page: the grid of heads (click one) and the five steps of one."""
    from .html import CSS, ERROR_HOOK, section_html
    from .live import CSS as PLAY_CSS
    from .live import JS as PLAY_JS

    t = check_lang(lang)
    w = mt.weights
    n = w.shape[-1]
    head_word = t["head"]
    grid = ['<div class="mgrid">']          # one row per layer; its heads wrap to the width
    focus = []
    for li in range(mt.n_layers):
        cells = []
        for h in range(mt.n_heads):
            m = w[li, h] if n <= GRID_TOKENS else pool(w[li, h], GRID_TOKENS, GRID_TOKENS)[0]
            on = (li + 1, h + 1) == (layer, head)
            label = f"{t['m_layer']} {li + 1}, {head_word} {h + 1}"
            cells.append(f'<div class="mcell"><span>{E(head_word)} {h + 1}</span>'
                         f"{_mini_svg(m, label, on, f'{li + 1}-{h + 1}')}</div>")
            focus.append(_focus_html(mt, lang, li + 1, h + 1, token, hidden=not on))
        grid.append(f'<div class="mlayer"><div class="mlab">{E(t["m_layer"])} {li + 1}</div>'
                    f'<div class="mheads">{"".join(cells)}</div></div>')
    grid.append("</div>")
    line = _strongest_line(mt, lang)
    pad = (f'<p>{E(t["m_padding"].format(p=len(mt.tokens) - mt.n_real))}</p>'
           if mt.n_real < len(mt.tokens) else "")
    one = mt.head(layer, head)
    about = t["m_about"].format(layers=mt.n_layers, heads=mt.n_heads, d=mt.d_model,
                                dh=mt.d_head)
    note = _note(mt, lang)
    warn = f'<p class="mwarn" role="note">{E(note)}</p>' if note else ""
    body = (f'<section class="trace"><h2>{E(t["m_title"].format(model=mt.model))}</h2>'
            f'{warn}<p>{E(about)}</p>'
            f'<p><b>{E(t["m_text"])}</b>: {E(mt.text)}</p>'
            f'<p><b>{E(t["m_tokens"].format(n=len(mt.tokens)))}</b>: '
            + " ".join(f"<code>{i + 1}:{E(x)}</code>" for i, x in enumerate(mt.tokens))
            + f"</p>{pad}" + (f"<p>{E(line)}</p>" if line else "")
            + f"<h3>{E(t['m_grid_page'])}</h3>" + "".join(grid) + "".join(focus)
            + "</section>"
            + f'<p class="legend">{E(t["m_head_note"].format(dh=mt.d_head))}</p>'
            + section_html(one, lang))
    return (f'<!doctype html><html lang="{lang}"><head><meta charset="utf-8">{GENERATOR_META}'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{E(t['m_title'].format(model=mt.model))}</title>"
            f"<style>{CSS}{PLAY_CSS}{MODEL_CSS}</style><script>{ERROR_HOOK}</script></head>"
            f"<body><main>{body}<pre id=\"js-errors\" hidden></pre>"
            f"<footer>{E(t['page_generated'])}</footer></main><div id=\"tip\"></div>"
            f"<script>{MODEL_JS}</script><script>{PLAY_JS}</script>{_page_script()}"
            "</body></html>\n")


def _page_script() -> str:
    from .html import JS

    return f"<script>{JS}</script>"


# ---------------------------------------------------------------------------- the PNG


def model_plot(mt: ModelTrace, path: str | Path, lang: str, layer: int, head: int,
               token: int) -> Path:
    """A PNG of the grid: every layer × head's weights (Blues, 0 → 1), the chosen head framed."""
    from matplotlib.figure import Figure

    from .plot import korean_font

    t = check_lang(lang)
    font = korean_font("plot's labels") if lang == "ko" else None
    if lang == "ko" and font is None:
        lang, t = "en", STRINGS["en"]
    import matplotlib as mpl

    w = mt.weights
    lab = mt.labels()
    n = w.shape[-1]
    L, H = w.shape[:2]
    fig = Figure(figsize=(1.25 * H + 1.5, 1.3 * L + 1.6), dpi=100, layout="constrained")
    family = ["DejaVu Sans", font] if font else ["DejaVu Sans"]
    with mpl.rc_context({"font.family": family}):
        axes = fig.subplots(L, H, squeeze=False)
        for li in range(L):
            for h in range(H):
                ax = axes[li, h]
                im = ax.imshow(w[li, h], cmap="Blues", vmin=0.0, vmax=1.0,
                               interpolation="nearest")
                ax.set_xticks([])
                ax.set_yticks([])
                if li == 0:
                    ax.set_title(f"{t['head']} {h + 1}", fontsize=8)
                if h == 0:
                    ax.set_ylabel(f"{t['m_layer']} {li + 1}", fontsize=8)
                if (li + 1, h + 1) == (layer, head):
                    for s in ax.spines.values():
                        s.set_edgecolor("#b00020")
                        s.set_linewidth(2.5)
                    ax.axhline(token - 1, color="#b00020", linewidth=0.8, alpha=0.7)
        fig.suptitle(t["m_title"].format(model=mt.model) + f"\n“{mt.text}”", fontsize=10)
        fig.colorbar(im, ax=axes, shrink=0.5, label=t["page_c_weights"])
        ticks = ", ".join(f"{i + 1}:{x}" for i, x in enumerate(lab[:n]))
        fig.supxlabel(ticks if len(ticks) < 220 else ticks[:217] + "…", fontsize=7)
    out = Path(path)
    fig.savefig(out, **savefig_kwargs(out))
    return out
