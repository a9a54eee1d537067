"""The renderers of a :class:`~attnkit.explain.model.ModelTrace`: text, HTML and PNG.

Each shows the same two things: the grid of every layer × head (text: where the chosen
query looks in each head; page and PNG: every head's weights over the tokens), and the
five steps of one head for one query token with the model's own numbers — raw q·k,
× scale (1/√d_h), the mask from padding, softmax, and the mixing o = Σ_j w_j v_j.

Shape legend::

    weights (L, H, n, n)   one head (n, n)   one query's row (n,)   its output o (d_v,)

After the chosen head's five steps the page has BertViz's two other views, drawn by its own
script from one JSON blob (:func:`head_view_data`): the *head view* (queries on the left,
keys on the right, a line per pair whose opacity is the weight, one colour per head, a chip
per head, a layer selector; a tapped or hovered query keeps only its lines; at first only the
chosen head is on, since 12 heads at once blur together) and the *neuron view* (the chosen
query and a tapped key: the d_h products q_d·k_d as bars, their sum — the cell 1. q·k — and
the sum × scale — the cell 2. × scale).

For a causal language model (``ModelTrace.logits``: tiny-ko, a Hugging Face decoder), the
chosen head's steps are followed by the *next-token view* (as Transformer Explainer's): the
logits for the token after the query and their probabilities softmax(z / T), with a
temperature slider (:func:`slider_temperature`; T = 0 is one-hot on the largest logit) —
the page's script recomputes all V probabilities from the logits it holds (full floats, about
5 kB for tiny-ko's 227 characters) and shows the ten most likely and the rest in one row, so
the rows add up to 1. The text prints the five most likely at T = 1.

The page ends with the chosen head's full matrices and, for a text of at most 16 tokens, the
playground of :mod:`.live` on that head's real Q, K, V (d_h wide rows drawn as strips).

Caution
-------
- The page draws every head as a small SVG (L·H·n² rectangles): at 6 × 12 heads and 14
  tokens about 14,000, some 1 MB. Above :data:`GRID_TOKENS` tokens the grid cells are the
  block means of :func:`~attnkit.explain.common.pool` (the page says so).
- The head view stores the weights in thousandths (a line under 0.001 is not drawn) and the
  neuron view q and k as float32 (base64): about 0.2 MB for MiniLM's 15 tokens. Above
  :data:`HEAD_VIEW_TOKENS` tokens both views are left out (the page says so).
- The page's scripts find their elements by class and id, so two model pages in one
  document (two notebook outputs) share the first one's controls.
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .._outfiles import GENERATOR_META, savefig_kwargs
from .common import fmt, pool
from .strings import STRINGS, check_lang
from .text import display_width

if TYPE_CHECKING:
    from .model import ModelTrace

__all__ = ["model_text", "model_html", "model_plot", "GRID_TOKENS", "HEAD_VIEW_TOKENS",
           "head_view_data", "head_color"]

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
    out += _causal_notes(mt, lang)
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
    if mt.logits is not None:
        out += ["", _next_text(mt, lang, token, decimals)]
    return "\n".join(out) + "\n"


def _causal_notes(mt: ModelTrace, lang: str) -> list[str]:
    """A causal model's lines before the grid: what of the text it could not read (a cut
    start, unknown characters) and its clearest previous-token head."""
    t = STRINGS[lang]
    out = []
    if mt.cut:
        out.append(t["m_cut"].format(n=len(mt.tokens), m=mt.cut))
    if mt.unknown:
        out.append(t["m_unknown"].format(n=mt.unknown, u=mt.vocab[0] if mt.vocab else "?"))
    if mt.causal:
        from .tiny import local_head

        found = local_head(mt.weights)
        if found is not None:
            li, h, w, even = found
            out.append(t["m_local"].format(l=li, h=h, w=fmt(w), u=fmt(even)))
    return out


NEXT_SHOWN = 5          # the text's top-k
NEXT_PAGE = 10          # the page's top-k (the rest summed in one row)


def _true_next(mt: ModelTrace, token: int) -> str | None:
    """The token that follows query ``token`` in the text itself (None after the last)."""
    return mt.tokens[token] if token < len(mt.tokens) else None


def _next_text(mt: ModelTrace, lang: str, token: int, decimals: int) -> str:
    """The next-token probabilities after query ``token`` at T = 1 (the k most likely)."""
    t = STRINGS[lang]
    lab = mt.labels()
    top = mt.next_token(token, 1.0, NEXT_SHOWN)
    out = [t["m_next_text"].format(tok=_q(lab[token - 1]), k=len(top),
                                   v=len(mt.vocab or []))]
    for name, p in top:
        out.append(f"  {_lj(_q(name), 6)} {fmt(p, decimals).rjust(decimals + 3)}  "
                   + "█" * int(round(30 * p)))
    nxt = _true_next(mt, token)
    if nxt is not None:
        out.append("  " + t["m_next_true"].format(tok=_q(nxt)))
    return "\n".join(out)


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
    line = " ".join(_causal_notes(mt, lang) + [_strongest_line(mt, lang) or ""]).strip()
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
            + _next_html(mt, lang, token)
            + _head_view_html(mt, lang, layer, head, token) + "</section>"
            + f'<p class="legend">{E(t["m_head_note"].format(dh=mt.d_head))}</p>'
            + section_html(one, lang))
    return (f'<!doctype html><html lang="{lang}"><head><meta charset="utf-8">{GENERATOR_META}'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{E(t['m_title'].format(model=mt.model))}</title>"
            f"<style>{CSS}{PLAY_CSS}{MODEL_CSS}{HEAD_VIEW_CSS}{NEXT_CSS}</style><script>{ERROR_HOOK}</script></head>"
            f"<body><main>{body}<pre id=\"js-errors\" hidden></pre>"
            f"<footer>{E(t['page_generated'])}</footer></main><div id=\"tip\"></div>"
            f"<script>{MODEL_JS}</script><script>{HEAD_VIEW_JS}</script><script>{NEXT_JS}</script><script>{PLAY_JS}</script>{_page_script()}"
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


# ------------------------------------------------- the head view and the neuron view

HEAD_VIEW_TOKENS = GRID_TOKENS     # above this many tokens neither view is drawn
# One colour per head (Tableau 10 and two more); more heads go round the wheel.
HEAD_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
               "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#b5651d")


def head_color(h: int) -> str:
    """The colour of head ``h`` (0-based) in the head view."""
    if h < len(HEAD_COLORS):
        return HEAD_COLORS[h]
    return f"hsl({(h * 137.5) % 360:.0f},60%,42%)"


def _b64(a: np.ndarray) -> str:
    import base64

    return base64.b64encode(np.ascontiguousarray(a, dtype="<f4").tobytes()).decode("ascii")


def head_view_data(mt: ModelTrace, layer: int, head: int, token: int) -> dict:
    """What the head view and the neuron view draw, compactly (the page's JSON).

    ``w``: every layer × head's weights in thousandths, one flat list of ints in the order
    (layer, head, query, key) — opacity = w / 1000; ``q``: the focus query's q of every
    layer × head, ``k``: every key's k (base64 little-endian float32, (L, H, d_h) and
    (L, H, n, d_h)); ``scale``: each layer's scale; ``focus``: (layer, head, token), 1-based.
    """
    w = mt.weights                                                  # (L, H, n, n)
    q = np.stack([tr.q[:, token - 1] for tr in mt.layers])          # (L, H, d_h)
    k = np.stack([tr.k for tr in mt.layers])                        # (L, H, n, d_h)
    return {"L": mt.n_layers, "H": mt.n_heads, "n": w.shape[-1], "dh": mt.d_head,
            "tokens": mt.labels(), "focus": [layer, head, token],
            "scale": [float(tr.scale) for tr in mt.layers],
            "w": np.rint(np.nan_to_num(w) * 1000).astype(int).ravel().tolist(),
            "q": _b64(q), "k": _b64(k),
            "colors": [head_color(h) for h in range(mt.n_heads)]}


def _head_view_html(mt: ModelTrace, lang: str, layer: int, head: int, token: int) -> str:
    import json

    t = STRINGS[lang]
    n = len(mt.tokens)
    if n > HEAD_VIEW_TOKENS:
        return f'<p class="legend">{E(t["m_hv_too_many"].format(n=HEAD_VIEW_TOKENS, m=n))}</p>'
    data = head_view_data(mt, layer, head, token)
    words = {k: t[k] for k in ("m_nv_focus", "m_nv_sum", "m_nv_scaled", "m_nv_scaled_other",
                               "m_nv_bar", "m_hv_q", "m_hv_k")}
    words["scale_ok"] = [abs(s * math.sqrt(mt.d_head) - 1) < 1e-6 for s in data["scale"]]
    opts = "".join(f'<option value="{li}"{" selected" if li == layer else ""}>'
                   f'{E(t["m_layer"])} {li}</option>' for li in range(1, mt.n_layers + 1))
    chips = "".join(
        f'<button type="button" class="hv-chip{" on" if h + 1 == head else ""}" '
        f'data-h="{h + 1}" aria-pressed="{"true" if h + 1 == head else "false"}" '
        f'style="--c:{head_color(h)}">{h + 1}</button>' for h in range(mt.n_heads))
    keys = "".join(f'<button type="button" class="nv-key" data-k="{j + 1}">{E(x)}</button>'
                   for j, x in enumerate(mt.labels()))
    blob = json.dumps({"data": data, "words": words}, separators=(",", ":"))
    blob = blob.replace("</", "<\\/")
    return (f'<div class="hvnv"><div class="hvcol"><h3>{E(t["m_hv_title"])}</h3>'
            f'<p class="legend">{E(t["m_hv_help"].format(h=mt.n_heads))}</p>'
            f'<div class="hview"><div class="hv-bar"><label>{E(t["m_layer"])} '
            f'<select class="hv-layer" aria-label="{E(t["m_layer"])}">{opts}</select></label>'
            f'<span class="hv-chips" role="group" aria-label="{E(t["head"])}">'
            f'<span class="hv-lab">{E(t["head"])}</span>{chips}</span>'
            f'<button type="button" class="hv-all">{E(t["m_hv_all"])}</button>'
            f'<button type="button" class="hv-none">{E(t["m_hv_none"])}</button></div>'
            f'<svg class="hv-svg" role="img" aria-label="{E(t["m_hv_title"])}"></svg></div></div>'
            f'<div class="nvcol"><h3>{E(t["m_nv_title"])}</h3>'
            f'<p class="legend">{E(t["m_nv_help"].format(dh=mt.d_head))}</p>'
            f'<div class="nview"><p class="nv-focus"></p>'
            f'<div class="nv-keys"><span class="hv-lab">{E(t["m_nv_key"])}</span>{keys}</div>'
            f'<svg class="nv-svg" viewBox="0 0 320 142" role="img" '
            f'aria-label="{E(t["m_nv_title"])}"></svg>'
            f'<p class="nv-sum"></p><p class="nv-scaled"></p></div></div></div>'
            f'<script type="application/json" id="hv-data">{blob}</script>')


HEAD_VIEW_CSS = """
.hvnv{display:flex;flex-wrap:wrap;gap:0 28px;align-items:flex-start}
.hvcol{flex:1 1 300px;min-width:0;max-width:460px}.nvcol{flex:1 1 300px;min-width:0}
.hv-bar{display:flex;flex-wrap:wrap;gap:6px 10px;align-items:center;margin:4px 0 8px;
 font:13px system-ui,sans-serif}
.hv-chips{display:flex;flex-wrap:wrap;gap:4px;align-items:center}
.hv-lab{color:var(--mute);margin-right:2px}
button.hv-chip{min-width:30px;height:28px;border-radius:14px;border:2px solid var(--c);
 background:#fff;color:var(--ink);font:12px system-ui,sans-serif;cursor:pointer;padding:0 6px}
button.hv-chip.on{background:var(--c);color:#fff}
button.hv-all,button.hv-none,button.nv-key{border:1px solid var(--line);background:#f7f8fb;
 border-radius:14px;padding:3px 10px;font:12px system-ui,sans-serif;cursor:pointer}
button.nv-key{padding:2px 7px;margin:0 3px 3px 0;max-width:10em;overflow:hidden;
 text-overflow:ellipsis;white-space:nowrap}
button.nv-key.on{background:var(--acc);color:#fff;border-color:var(--acc)}
svg.hv-svg{display:block;width:100%;max-width:440px;height:auto;touch-action:manipulation}
svg.hv-svg text{font:12px system-ui,sans-serif;fill:var(--ink);cursor:pointer}
svg.hv-svg text.dim{fill:#b8bfcc}
svg.hv-svg rect.hit{fill:transparent;cursor:pointer}
svg.hv-svg rect.sel{fill:#e8efff}
svg.nv-svg{display:block;width:100%;max-width:640px;height:auto}
.nv-keys{display:flex;flex-wrap:wrap;align-items:center;margin:4px 0}
.nv-sum,.nv-scaled{font:14px ui-monospace,monospace;margin:4px 0;overflow-wrap:anywhere}
svg.nv-svg text.nv-ax{font:9px system-ui,sans-serif;fill:var(--mute)}
"""

HEAD_VIEW_JS = """
(function(){
  var el=document.getElementById('hv-data'); if(!el) return;
  var all=JSON.parse(el.textContent), D=all.data, T=all.words;
  var L=D.L, H=D.H, n=D.n, dh=D.dh, tok=D.tokens, W=D.w;
  function f32(s){var b=atob(s), u=new Uint8Array(b.length);
    for(var i=0;i<b.length;i++) u[i]=b.charCodeAt(i); return new Float32Array(u.buffer);}
  var Q=f32(D.q), K=f32(D.k);
  var NS=document.querySelector('svg.hv-svg').namespaceURI;   // inline SVG's own
  function mk(tag,attrs,parent){var e=document.createElementNS(NS,tag);
    for(var a in attrs) e.setAttribute(a,attrs[a]); if(parent) parent.appendChild(e); return e;}
  function fill(s,o){return s.replace(/\\{(\\w+)\\}/g,function(m,k){return k in o?o[k]:m;});}
  function fmt(x){ if(x===0) return '0'; return x.toFixed(3); }
  function w(l,h,i,j){return W[(((l-1)*H+(h-1))*n+i)*n+j];}   // thousandths
  // ---- the head view
  var st={layer:D.focus[0], heads:{}, q:null, pin:null};
  st.heads[D.focus[1]]=true;
  var svg=document.querySelector('svg.hv-svg'), sel=document.querySelector('select.hv-layer');
  function clip(s){return s.length>14?s.slice(0,13)+'\\u2026':s;}
  var longest=Math.max.apply(null,tok.map(function(s){return clip(s).length;}).concat([6]));
  var LAB=longest*7+12, ROW=22, TOP=30, X1=LAB, X2=LAB+110, WIDE=2*LAB+110;
  svg.setAttribute('viewBox','0 0 '+WIDE+' '+(TOP+n*ROW+4));
  svg.style.maxWidth=Math.round(WIDE*1.15)+'px';
  var lines=mk('g',{'class':'hv-lines'},svg), labs=mk('g',{},svg);
  var qlab=[], klab=[], qsel=[];
  mk('text',{x:X1-6,y:12,'text-anchor':'end','class':'dim'},labs).textContent=T.m_hv_q;
  mk('text',{x:X2+6,y:12,'class':'dim'},labs).textContent=T.m_hv_k;
  for(var i=0;i<n;i++){
    var y=TOP+i*ROW;
    qsel.push(mk('rect',{x:0,y:y-ROW/2+2,width:X1-2,height:ROW-4,rx:4,'class':'hit'},labs));
    var a=mk('text',{x:X1-6,y:y+4,'text-anchor':'end','class':'hv-q','data-q':i+1},labs);
    a.textContent=clip(tok[i]); qlab.push(a);
    var b=mk('text',{x:X2+6,y:y+4,'class':'hv-k','data-k':i+1},labs);
    b.textContent=clip(tok[i]); klab.push(b);
    mk('title',{},a).textContent=tok[i]; mk('title',{},b).textContent=tok[i];
  }
  function draw(){
    while(lines.firstChild) lines.removeChild(lines.firstChild);
    var only=st.pin!==null?st.pin:st.q;
    for(var h=1;h<=H;h++){ if(!st.heads[h]) continue;
      for(var i=0;i<n;i++){ if(only!==null&&only!==i) continue;
        for(var j=0;j<n;j++){ var v=w(st.layer,h,i,j); if(v<1) continue;
          mk('line',{x1:X1,y1:TOP+i*ROW,x2:X2,y2:TOP+j*ROW,stroke:D.colors[h-1],
                     'stroke-width':2,'stroke-opacity':(v/1000).toFixed(3),
                     'data-h':h,'data-q':i+1,'data-k':j+1},lines);
        }}}
    for(var i=0;i<n;i++){
      qlab[i].setAttribute('class','hv-q'+(only!==null&&only!==i?' dim':''));
      qsel[i].setAttribute('class',st.pin===i?'sel':'hit');
    }
    svg.setAttribute('data-layer',st.layer);
    svg.setAttribute('data-heads',Object.keys(st.heads).filter(function(h){
      return st.heads[h];}).join(','));
    svg.setAttribute('data-query',only===null?'':only+1);
  }
  function chips(){
    document.querySelectorAll('button.hv-chip').forEach(function(c){
      var on=!!st.heads[c.getAttribute('data-h')];
      c.classList.toggle('on',on); c.setAttribute('aria-pressed',on?'true':'false');});
    draw();
  }
  document.querySelectorAll('button.hv-chip').forEach(function(c){
    c.addEventListener('click',function(){
      var h=c.getAttribute('data-h'); st.heads[h]=!st.heads[h]; chips();});
  });
  document.querySelector('button.hv-all').addEventListener('click',function(){
    for(var h=1;h<=H;h++) st.heads[h]=true; chips();});
  document.querySelector('button.hv-none').addEventListener('click',function(){
    st.heads={}; chips();});
  sel.addEventListener('change',function(){ st.layer=+sel.value; draw(); });
  function onq(i){
    function enter(){ st.q=i; draw(); }
    function leave(){ st.q=null; draw(); }
    function tap(ev){ ev.stopPropagation(); st.pin=st.pin===i?null:i; st.q=null; draw(); }
    [qlab[i],qsel[i]].forEach(function(e){
      e.addEventListener('mouseenter',enter); e.addEventListener('mouseleave',leave);
      e.addEventListener('click',tap);});
  }
  for(var i=0;i<n;i++){ onq(i);
    (function(j){ klab[j].addEventListener('click',function(){ setKey(j+1,true); }); })(i); }
  // ---- the neuron view: the focus query and one key, dimension by dimension
  var nv={layer:D.focus[0], head:D.focus[1], key:null, chosen:false};
  var nsvg=document.querySelector('svg.nv-svg');
  function best(){ var b=0, bv=-1;
    for(var j=0;j<n;j++){ var v=w(nv.layer,nv.head,D.focus[2]-1,j); if(v>bv){bv=v;b=j;} }
    return b+1; }
  function setKey(k,chosen){ nv.key=k; nv.chosen=nv.chosen||chosen; neuron(); }
  function neuron(){
    var l=nv.layer, h=nv.head, j=nv.key-1, qi=D.focus[2]-1;
    var qo=((l-1)*H+(h-1))*dh, ko=(((l-1)*H+(h-1))*n+j)*dh;
    var p=[], s=0;
    for(var d=0;d<dh;d++){ var x=Q[qo+d]*K[ko+d]; p.push(x); s+=x; }
    var x=s*D.scale[l-1];
    while(nsvg.firstChild) nsvg.removeChild(nsvg.firstChild);
    var top=0, bot=0;
    for(var d=0;d<dh;d++){ top=Math.max(top,p[d]); bot=Math.min(bot,p[d]); }
    var span=Math.max(top-bot,1e-9), amp=110/span, bw=320/dh, mid=8+top*amp;
    mk('line',{x1:0,y1:mid,x2:320,y2:mid,stroke:'#9aa3b5','stroke-width':0.6},nsvg);
    [[1,0,'start'],[dh,320,'end']].forEach(function(a){
      mk('text',{x:a[1],y:138,'text-anchor':a[2],'class':'nv-ax'},nsvg).textContent='d = '+a[0];
    });
    mk('text',{x:160,y:138,'text-anchor':'middle','class':'nv-ax'},nsvg).textContent=
      'max '+fmt(top)+(bot<0?' \\u00b7 min '+fmt(bot):'');
    for(var d=0;d<dh;d++){
      var hgt=Math.abs(p[d])*amp;
      var r=mk('rect',{x:(d*bw+bw*0.1).toFixed(2),y:(p[d]>=0?mid-hgt:mid).toFixed(2),
        width:(bw*0.8).toFixed(2),height:Math.max(hgt,0.5).toFixed(2),
        fill:p[d]>=0?'#2463eb':'#c62828','class':'nv-bar','data-d':d+1,
        'data-p':p[d]},nsvg);
      mk('title',{},r).textContent=fill(T.m_nv_bar,{d:d+1,q:fmt(Q[qo+d]),k:fmt(K[ko+d]),
                                                      p:fmt(p[d])});
    }
    document.querySelector('.nv-focus').textContent=fill(T.m_nv_focus,{l:l,h:h,
      q:"'"+tok[qi]+"'",k:"'"+tok[j]+"'"});
    var c1=document.querySelector('.nv-sum'), c2=document.querySelector('.nv-scaled');
    c1.textContent=fill(T.m_nv_sum,{s:fmt(s)});
    c2.textContent=T.scale_ok[l-1]?fill(T.m_nv_scaled,{s:fmt(s),dh:dh,x:fmt(x)})
      :fill(T.m_nv_scaled_other,{s:fmt(s),scale:fmt(D.scale[l-1]),x:fmt(x)});
    c1.setAttribute('data-v',s); c2.setAttribute('data-v',x);
    nsvg.setAttribute('data-layer',l); nsvg.setAttribute('data-head',h);
    nsvg.setAttribute('data-query',qi+1); nsvg.setAttribute('data-key',j+1);
    document.querySelectorAll('button.nv-key').forEach(function(b){
      b.classList.toggle('on',+b.getAttribute('data-k')===j+1);});
  }
  document.querySelectorAll('button.nv-key').forEach(function(b){
    b.addEventListener('click',function(){ setKey(+b.getAttribute('data-k'),true); });});
  // a head chosen in the grid above: the neuron view follows it, the head view shows it
  document.querySelectorAll('button.mini').forEach(function(b){
    b.addEventListener('click',function(){
      var lh=b.getAttribute('data-head').split('-');
      nv.layer=+lh[0]; nv.head=+lh[1]; if(!nv.chosen) nv.key=best(); neuron();
      st.layer=nv.layer; sel.value=String(st.layer); st.heads={}; st.heads[nv.head]=true;
      chips();
    });
  });
  nv.key=best(); neuron(); chips();
})();
"""


# ------------------------------------------------- the next-token view (a causal model)


def slider_temperature(s: int) -> float:
    """The temperature at slider position ``s`` (0..100): 0 at the left end (one-hot),
    else 10^((s − 50)/30) — s = 50 is T = 1, the right end T ≈ 46 (nearly uniform). The
    page's script uses the same rule."""
    return 0.0 if s <= 0 else 10.0 ** ((s - 50) / 30)


def next_data(mt: ModelTrace, token: int) -> dict:
    """What the next-token view computes from: the logits after query ``token`` (full
    floats), the rows shown (the top-k at T = 1, an order no T > 0 changes) and the token
    that follows in the text."""
    assert mt.logits is not None and mt.vocab is not None
    z = mt.logits[token - 1]                                          # (V,)
    order = np.argsort(-z, kind="stable")[:NEXT_PAGE]
    return {"z": [float(x) for x in z], "top": [int(j) for j in order],
            "next": _true_next(mt, token)}


def _next_html(mt: ModelTrace, lang: str, token: int) -> str:
    """The next-token view: the top-k probabilities after the query and a temperature
    slider (the page's script recomputes softmax(z / T) from the embedded logits)."""
    import json

    from .model import next_probabilities

    if mt.logits is None or mt.vocab is None:
        return ""
    t = STRINGS[lang]
    lab = mt.labels()
    data = next_data(mt, token)
    p = next_probabilities(np.asarray(data["z"]), 1.0)               # (V,)
    rows = []
    for j in data["top"]:
        mark = ' class="nx-true"' if mt.vocab[j] == data["next"] else ""
        rows.append(f'<tr data-j="{j}"{mark}><td class="nx-tok">{E(_q(mt.vocab[j]))}</td>'
                    f'<td class="nx-z">{E(fmt(float(data["z"][j])))}</td>'
                    f'<td class="nx-barc"><span class="nx-bar" style="width:'
                    f'{100 * p[j]:.1f}%"></span></td>'
                    f'<td class="nx-p" data-p="{float(p[j])!r}">{E(fmt(float(p[j])))}</td></tr>')
    rest = max(float(1.0 - p[data["top"]].sum()), 0.0)
    n_rest = len(mt.vocab) - len(data["top"])
    rows.append(f'<tr class="nx-rest"><td colspan="2">{E(t["m_next_rest"].format(n=n_rest))}'
                f'</td><td class="nx-barc"><span class="nx-bar" style="width:{100 * rest:.1f}%">'
                f'</span></td><td class="nx-p" data-p="{rest!r}">{E(fmt(rest))}</td></tr>')
    nxt = data["next"]
    true = (f'<p class="legend">{E(t["m_next_true"].format(tok=_q(nxt)))}</p>'
            if nxt is not None else "")
    words = {"greedy": t["m_next_greedy"], "sum": t["m_next_sum"]}
    blob = json.dumps({"data": data, "words": words}, separators=(",", ":"),
                      ensure_ascii=False).replace("</", "<\\/")
    head = (f'<tr><th>{E(t["m_next_tok"])}</th><th>{E(t["m_next_z"])}</th><th></th>'
            f'<th>{E(t["m_next_p"])}</th></tr>')
    return (f'<div class="nextv"><h3>{E(t["m_next_title"].format(tok=_q(lab[token - 1])))}'
            f'</h3><p class="legend">{E(t["m_next_help"].format(v=len(mt.vocab)))}</p>'
            f'<label class="nx-tl">{E(t["m_next_t"])} <input type="range" class="nx-t" '
            f'min="0" max="100" step="1" value="50" aria-label="{E(t["m_next_t"])}">'
            f'<output class="nx-tv" data-t="1">T = 1.00</output></label>'
            f'<div class="mwrap"><table class="nx">{head}{"".join(rows)}</table></div>'
            f'<p class="nx-sum" data-v="1">{E(t["m_next_sum"].format(s=fmt(1.0)))}</p>{true}'
            f'<script type="application/json" id="nx-data">{blob}</script></div>')


NEXT_CSS = """
.nextv{margin:14px 0 6px}
.nx-tl{display:flex;flex-wrap:wrap;align-items:center;gap:6px 10px;
 font:13px system-ui,sans-serif;margin:6px 0}
.nx-tl input{flex:1 1 160px;max-width:320px}
.nx-tv{font:13px ui-monospace,monospace;min-width:9em}
table.nx{border-collapse:collapse;font:13px ui-monospace,monospace;width:100%;max-width:520px}
table.nx td,table.nx th{padding:2px 8px;border-bottom:1px solid var(--line);text-align:right}
table.nx td:first-child,table.nx th:first-child{text-align:left}
table.nx td.nx-barc{width:45%;text-align:left}
.nx-bar{display:inline-block;height:10px;background:#08306b;vertical-align:middle;
 max-width:100%}
tr.nx-true td.nx-tok{font-weight:bold;color:#b00020}
tr.nx-rest td{color:var(--mute)}
.nx-sum{font:13px ui-monospace,monospace}
"""

NEXT_JS = """
(function(){
  var el=document.getElementById('nx-data'); if(!el) return;
  var all=JSON.parse(el.textContent), D=all.data, T=all.words, z=D.z, V=z.length;
  var box=el.parentNode, sl=box.querySelector('input.nx-t'), out=box.querySelector('.nx-tv');
  function fmt(x){ var s=x.toFixed(3); return s==='-0.000'?'0.000':s; }
  function temp(s){ return s<=0?0:Math.pow(10,(s-50)/30); }
  function probs(t){                       // softmax(z / T), max-subtracted; T = 0: one-hot
    var m=-Infinity, a=0, p=new Array(V), s=0, i;
    for(i=0;i<V;i++) if(z[i]>m){ m=z[i]; a=i; }
    if(t===0){ for(i=0;i<V;i++) p[i]=i===a?1:0; return p; }
    for(i=0;i<V;i++){ p[i]=Math.exp((z[i]-m)/t); s+=p[i]; }
    for(i=0;i<V;i++) p[i]/=s;
    return p;
  }
  function setRow(r,x){
    var c=r.querySelector('td.nx-p'); c.textContent=fmt(x); c.setAttribute('data-p',x);
    r.querySelector('.nx-bar').style.width=(100*x).toFixed(1)+'%';
  }
  function show(){
    var t=temp(+sl.value), p=probs(t), shown=0, sum=0, i;
    out.textContent=t===0?T.greedy:'T = '+(t<10?t.toFixed(2):t.toFixed(1));
    out.setAttribute('data-t',t);
    box.querySelectorAll('tr[data-j]').forEach(function(r){
      var x=p[+r.getAttribute('data-j')]; shown+=x; setRow(r,x);});
    for(i=0;i<V;i++) sum+=p[i];
    setRow(box.querySelector('tr.nx-rest'),Math.max(sum-shown,0));
    var c=box.querySelector('.nx-sum');
    c.textContent=T.sum.replace('{s}',fmt(sum)); c.setAttribute('data-v',sum);
    box.setAttribute('data-state',JSON.stringify({slider:+sl.value,t:t}));
  }
  sl.addEventListener('input',show); sl.addEventListener('change',show);
  show();
})();
"""
