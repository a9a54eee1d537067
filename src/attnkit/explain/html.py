"""The HTML renderer: one self-contained page for one or more traces (inline CSS, JS, SVG).

The page shows the formula, the flow of the five steps (the diagram draws Score → Scale &
Mask → Softmax → Weighted sum: steps 2 and 3 share a box) with the shape on every arrow,
the five-step table, and every step's matrix as a heatmap (the value in the cell when it
fits, and on a tap or hover). Multi-head traces get one tab per head. Words come from
:mod:`.strings`, numbers, labels and budgets from :mod:`.common`.

Shape legend::

    Q (n_q, d_k)  K (n_k, d_k)  V (n_k, d_v)  S, X, L, W (n_q, n_k)  O (n_q, d_v)
    (h, …) with heads: one tab per head; the concatenated output is (n_q, h·d_v)

Caution
-------
- Size: a trace of up to 40,000 cells in all (:data:`~attnkit.explain.common.PAGE_CELLS`;
  the 8-head base-model example is about 29,000, 1 MB) is shown cell by cell. A larger one
  is drawn in blocks: every heatmap with more than g rows or columns (g from 8 to 48, so the
  page stays near 2 MB at most) shows one cell per block, coloured by the block's mean, and
  the page says so. At most 8 heads get a tab (:data:`~attnkit.explain.common.MAX_HEADS`);
  the page names the rest.
- Any script error is written into the page (``#js-errors``) so a test can see it.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .._outfiles import GENERATOR_META
from .common import (
    MAX_HEADS,
    NEG_RGB,
    POS_RGB,
    WEIGHTS_RGB,
    axis_labels,
    block_labels,
    block_sizes,
    cell_formatter,
    fmt,
    head_label,
    kv_head_index,
    n_matrices,
    page_grid,
    pool,
    shape_str,
    split_heads,
)
from .guard import check_decimals
from .live import CSS as PLAY_CSS
from .live import JS as PLAY_JS
from .live import playground
from .remarks import remarks
from .strings import STRINGS, check_lang, mask_label, step_formula, step_name, step_what

if TYPE_CHECKING:
    from .trace import Trace

__all__ = ["render_html", "section_html", "heatmap", "flow_svg", "cell_color", "CSS", "JS",
           "ERROR_HOOK"]

CSS = """
:root{--ink:#1d2330;--mute:#5b6475;--line:#d9dee8;--card:#fff;--bg:#f4f6fa;--acc:#2463eb}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--ink);
 font:15px/1.5 system-ui,-apple-system,"Segoe UI","Noto Sans CJK KR","Noto Sans KR",
 "NanumGothic","Apple SD Gothic Neo","Malgun Gothic",sans-serif}
main{max-width:1120px;margin:0 auto;padding:24px}
header h1{margin:0 0 4px;font-size:26px}
.formula{font:600 20px/1.4 "DejaVu Serif",Georgia,serif;background:#eef3ff;border:1px solid
 #cfdcff;border-radius:8px;padding:10px 16px;display:inline-block;margin:8px 0}
.formula .sub{font-size:14px;font-weight:400;color:var(--mute);margin-left:14px}
.legend{color:var(--mute);margin:4px 0 16px}
section.trace{background:var(--card);border:1px solid var(--line);border-radius:12px;
 padding:18px 22px;margin:18px 0;box-shadow:0 1px 3px rgba(20,30,60,.06)}
section.trace h2{margin:0 0 6px;font-size:20px}
.intro{white-space:pre-wrap;color:#333b4d;margin:6px 0 12px;font-size:14px}
h3{font-size:16px;margin:18px 0 6px}
svg.flow{width:100%;height:auto;display:block;margin:6px 0 8px}
.flow .box{fill:#eef3ff;stroke:#7c9cf0;stroke-width:1.5}
.flow .io{fill:#f3f4f7;stroke:#9aa3b5;stroke-width:1.2}
.flow text{font:13px system-ui,sans-serif;fill:var(--ink)}
.flow .name{font-weight:700}
.flow .steps{font-size:11px;fill:var(--mute)}
.flow .shape{fill:#b4361f;font:12px ui-monospace,monospace}
.flow .arrow{stroke:#5b6475;stroke-width:1.5;fill:none;marker-end:url(#ah)}
.flow-v .arrow{marker-end:url(#ahv)}
.flow-wrap svg.flow-v{display:none;max-width:400px}
.flow a:hover .box{fill:#dce7ff}
table.steps{border-collapse:collapse;font-size:14px;margin:4px 0 10px}
table.steps th,table.steps td{border-bottom:1px solid var(--line);padding:4px 10px;
 text-align:left}
table.steps td.f{font-family:ui-monospace,monospace}
.steps-wrap{max-width:100%;overflow-x:auto}
.tabs{display:flex;gap:6px;flex-wrap:wrap;margin:10px 0}
.tabs button{border:1px solid var(--line);background:#f7f8fb;border-radius:16px;
 padding:3px 12px;cursor:pointer;font:inherit}
.tabs button.on{background:var(--acc);color:#fff;border-color:var(--acc)}
.grid{display:flex;flex-wrap:wrap;gap:14px 22px;align-items:flex-start}
.card{border:1px solid var(--line);border-radius:10px;padding:10px 12px;background:#fcfdff;
 max-width:100%;overflow-x:auto}
.card h4{margin:0 0 2px;font-size:14px}
.card .what{color:var(--mute);font-size:13px;margin-bottom:4px}
.card .f{font-family:ui-monospace,monospace;font-size:13px}
.card .shp{color:#b4361f;font-family:ui-monospace,monospace;font-size:12px}
table.hm{border-collapse:separate;border-spacing:1px;font:12px ui-monospace,monospace;
 margin-top:6px}
table.hm th{font-weight:600;color:var(--mute);padding:1px 5px;white-space:nowrap}
table.hm th.r{text-align:right}
table.hm td{min-width:44px;height:24px;text-align:center;padding:0 4px;border-radius:3px;
 cursor:default}
table.hm td[data-v]{cursor:pointer}
table.hm.small td{min-width:9px;height:12px;padding:0;font-size:0}
table.hm.small thead th{font-size:10px;padding:0 1px;text-align:left;max-width:9px;overflow:visible}
table.hm td.sum{background:none;color:var(--mute);border-left:2px solid var(--line)}
table.hm td.x{background:repeating-linear-gradient(45deg,#e6e8ee 0 4px,#f6f7fa 4px 8px);
 color:#8a93a5}
table.hm td:hover,table.hm td.on{outline:2px solid #111}
.notes li{margin:3px 0}
.colors{color:var(--mute);font-size:13px;margin:0 0 8px}
.sw{display:inline-block;width:14px;height:14px;border:1px solid var(--line);
 border-radius:3px;vertical-align:-2px;margin:0 1px}
.sw.x{background:repeating-linear-gradient(45deg,#e6e8ee 0 4px,#f6f7fa 4px 8px)}
#tip{position:fixed;pointer-events:none;background:#1d2330;color:#fff;padding:4px 8px;
 border-radius:6px;font:12px ui-monospace,monospace;display:none;z-index:10}
#js-errors{color:#b00020;white-space:pre-wrap}
footer{color:var(--mute);font-size:12px;margin:20px 0}
html[lang=ko] body{word-break:keep-all;overflow-wrap:break-word}
@media (max-width:900px){.flow-wrap svg.flow{display:none}.flow-wrap svg.flow.flow-v{display:block}}
@media (max-width:600px){main{padding:10px}section.trace{padding:12px 10px}
 header h1{font-size:21px}.formula{font-size:16px;padding:8px 10px}
 table.steps,table.steps tbody,table.steps tr,table.steps td{display:block;width:100%}
 table.steps thead{display:none}
 table.steps tr{border:1px solid var(--line);border-radius:8px;margin:0 0 8px;padding:4px 0}
 table.steps td{border:0;padding:2px 10px;display:flex;gap:10px}
 table.steps td::before{content:attr(data-label);flex:0 0 6.5em;color:var(--mute);
  font:12px/1.9 system-ui,sans-serif}
 table.steps td.n{font-weight:700}}
"""

JS = """
(function(){
  var tip=document.getElementById('tip'), pinned=null;
  function place(x,y){                  // the tip's corner near (x, y), kept inside the window
    var vw=document.documentElement.clientWidth, vh=window.innerHeight;
    tip.style.left=Math.max(4,Math.min(x,vw-tip.offsetWidth-4))+'px';
    tip.style.top=(y+tip.offsetHeight>vh-4?Math.max(4,y-tip.offsetHeight-40):y)+'px';
  }
  function unpin(){ if(pinned){pinned.classList.remove('on'); pinned=null;} }
  function hide(){ unpin(); tip.style.display='none'; }
  document.querySelectorAll('table.hm').forEach(function(t){
    var step=t.getAttribute('data-step')||'';
    var cols=[].map.call(t.querySelectorAll('thead th'),function(h){
      return h.getAttribute('data-l')||h.textContent;});
    function show(td){
      var row=td.parentNode.querySelector('th').textContent;
      var col=cols[td.cellIndex]||'';
      tip.textContent=step+'  '+row+' \\u2192 '+col+' = '+td.getAttribute('data-v');
      tip.style.display='block';
    }
    t.addEventListener('mouseover',function(ev){
      var td=ev.target.closest('td[data-v]'); if(!td) return;
      if(pinned&&pinned!==td) unpin();
      show(td);
    });
    t.addEventListener('mousemove',function(ev){
      if(!pinned) place(ev.clientX+14,ev.clientY+12);
    });
    t.addEventListener('mouseleave',function(){ if(!pinned) tip.style.display='none'; });
    // a tap (a touch screen has no hover) or a click shows the value and keeps it until the
    // next tap elsewhere; tapping the same cell again hides it
    t.addEventListener('click',function(ev){
      var td=ev.target.closest('td[data-v]'); if(!td) return;
      ev.stopPropagation();
      if(pinned===td){ hide(); return; }
      unpin(); pinned=td; td.classList.add('on'); show(td);
      follow();
    });
  });
  // the pinned tip stays under its cell while the page (or a heatmap's own box) scrolls, and
  // hides once the cell has left the window: a scroll that was still on its way when the tap
  // came (after scrollIntoView, say) must not hide the value the tap just showed
  function follow(){
    var r=pinned.getBoundingClientRect();
    if(r.bottom<0||r.top>window.innerHeight){ hide(); return; }
    place(r.left,r.bottom+6);
  }
  document.addEventListener('click',function(){ if(pinned) hide(); });
  document.addEventListener('scroll',function(){ if(pinned) follow(); },
                            {capture:true,passive:true});
  document.querySelectorAll('.tabs').forEach(function(bar){
    var sec=bar.parentNode;
    bar.querySelectorAll('button').forEach(function(b){
      b.addEventListener('click',function(){
        bar.querySelectorAll('button').forEach(function(x){x.classList.remove('on');});
        b.classList.add('on');
        sec.querySelectorAll(':scope > .head').forEach(function(p){
          p.hidden = p.getAttribute('data-head')!==b.getAttribute('data-head');
        });
      });
    });
  });
  document.body.setAttribute('data-ready','1');
})();
"""

ERROR_HOOK = """
window.__errors=[];
window.addEventListener('error',function(e){
  window.__errors.push(String(e.message||e));
  var p=document.getElementById('js-errors');
  if(p){p.textContent=window.__errors.join('\\n');p.hidden=false;}
});
"""

E = html.escape
FORMULA_HTML = ("O = softmax( Q K<sup>T</sup> · scale + M ) V"
                "<span class=\"sub\">  scale = 1/√d<sub>k</sub></span>")


def _hex(rgb: tuple[float, float, float]) -> str:
    return "#" + "".join(f"{int(round(255 * min(max(c, 0.0), 1.0))):02x}" for c in rgb)


def _mix(a: tuple[float, ...], b: tuple[float, ...], t: float) -> tuple[float, float, float]:
    return (a[0] + (b[0] - a[0]) * t, a[1] + (b[1] - a[1]) * t, a[2] + (b[2] - a[2]) * t)


_WHITE = (1.0, 1.0, 1.0)


def cell_color(v: float, kind: str, vmax: float) -> tuple[str, bool]:
    """(background hex, dark?) for a value: weights 0..1 white→blue; others diverge at 0
    (positive red, negative blue — the plot's Blues and RdBu_r)."""
    if kind == "weights":
        t = min(max(v, 0.0), 1.0) ** 0.8
        return _hex(_mix(_WHITE, WEIGHTS_RGB, t)), t > 0.5
    t = min(abs(v) / vmax, 1.0) if vmax > 0 else 0.0
    return _hex(_mix(_WHITE, POS_RGB if v >= 0 else NEG_RGB, t * 0.9)), t > 0.55


def heatmap(m: np.ndarray, rows: Sequence[str], cols: Sequence[str], kind: str, step: str,
            decimals: int = 3, sums: bool = False, grid: int | None = None) -> str:
    """One matrix as an HTML table: a coloured cell per value, the value in ``data-v``.

    With ``grid``, a matrix of more than ``grid`` rows or columns is drawn in blocks
    (:func:`~attnkit.explain.common.pool`): one cell per block, its mean as the value, the
    block's first–last labels as row / column names.
    """
    m = np.atleast_2d(m)
    row_sums = m.sum(-1) if sums else None                  # (n_q,) of the full rows
    if grid is not None:
        m, fr, fc = pool(m, grid, grid)
        rows, cols = block_labels(rows, fr), block_labels(cols, fc)
        if row_sums is not None:
            row_sums = pool(row_sums[:, None], grid, 1)[0][:, 0]
    fin = m[np.isfinite(m)]
    vmax = float(np.abs(fin).max()) if fin.size else 1.0
    small = m.shape[1] > 12 or m.shape[0] > 24
    f = cell_formatter(m, decimals)
    out = [f'<table class="hm{" small" if small else ""}" data-step="{E(step)}">',
           "<thead><tr><th></th>" + "".join(
               f'<th data-l="{E(c)}">{E(c) if not small or j % 8 == 0 else ""}</th>'
               for j, c in enumerate(cols))
           + ("<th>Σ</th>" if sums else "") + "</tr></thead><tbody>"]
    for i in range(m.shape[0]):
        cells = []
        for j in range(m.shape[1]):
            v = float(m[i, j])
            s = f(v)
            if math.isinf(v) and v < 0:
                cells.append(f'<td class="x" data-v="-inf">{"" if small else "−∞"}</td>')
                continue
            if math.isnan(v):                                 # a NaN input shows as NaN
                cells.append(f'<td class="x" data-v="nan">{"" if small else "nan"}</td>')
                continue
            bg, dark = cell_color(v, kind, vmax)
            color = ";color:#fff" if dark else ""
            cells.append(f'<td style="background:{bg}{color}" data-v="{s}">'
                         f'{"" if small else s}</td>')
        if row_sums is not None:
            cells.append(f'<td class="sum">{fmt(float(row_sums[i]), decimals)}</td>')
        out.append(f'<tr><th class="r">{E(rows[i])}</th>{"".join(cells)}</tr>')
    out.append("</tbody></table>")
    return "".join(out)


def flow_svg(trace: Trace, lang: str, anchor: str, narrow: bool = False) -> str:
    """The flow diagram: Q, K → Score → Scale & Mask → Softmax → Weighted sum (← V) → O.

    The five steps in four boxes: Scale (step 2) and Mask (step 3) share one. The wide
    layout runs left to right (1104 × 190); ``narrow=True`` stacks the same boxes top to
    bottom (340 wide), which the page shows instead on a narrow screen (see CSS), so that at
    360 px the whole diagram fits the phone with its text near full size.
    """
    t = STRINGS[lang]
    n_q, n_k = trace.scores.shape[-2:]
    d_k, d_v = trace.q.shape[-1], trace.v.shape[-1]
    h = n_matrices(trace.scores)
    qk = shape_str((n_q, n_k))                     # shapes are per head
    stages = [("stage_score", "f_score", 1), ("stage_scale_mask", "f_scale_mask", 2),
              ("stage_softmax", "f_softmax", 4), ("stage_sum", "f_sum", 5)]
    names = [step_name(st, lang) for st in trace.steps]       # the step table's own names
    nums = {1: "1. " + names[0], 2: f"2. {names[1]} · 3. {names[2]}", 4: "4. " + names[3],
            5: "5. " + names[4]}
    mark = "ahv" if narrow else "ah"               # each layout its own arrowhead (one is hidden)
    width, height = (340, 600 if h > 1 else 566) if narrow else (1104, 190)
    parts = [f'<svg class="flow{" flow-v" if narrow else ""}" viewBox="0 0 {width} {height}" '
             f'role="img" aria-label="{E(t["page_flow"])}">',
             f'<defs><marker id="{mark}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
             'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
             'fill="#5b6475"/></marker></defs>']

    def io(x: float, y: float, name: str, shape: str) -> None:
        parts.append(f'<rect class="io" x="{x}" y="{y}" width="96" height="44" rx="6"/>'
                     f'<text class="name" x="{x + 48}" y="{y + 19}" text-anchor="middle">'
                     f'{E(name)}</text><text class="shape" x="{x + 48}" y="{y + 36}" '
                     f'text-anchor="middle">{E(shape)}</text>')

    def box(x: float, y: float, w: float, name: str, formula: str, step: int) -> None:
        c = x + w / 2
        parts.append(f'<a href="#{anchor}-s{step}"><rect class="box" x="{x}" y="{y}" '
                     f'width="{w}" height="72" rx="10"/>'
                     f'<text class="name" x="{c}" y="{y + 20}" text-anchor="middle">'
                     f'{E(t["page_" + name])}</text><text class="steps" x="{c}" y="{y + 38}" '
                     f'text-anchor="middle">{E(nums[step])}</text><text x="{c}" y="{y + 58}" '
                     f'text-anchor="middle">{E(t["page_" + formula])}</text></a>')

    def arrow(d: str) -> None:
        parts.append(f'<path class="arrow" d="{d}"/>')

    def shape(x: float, y: float, text: str, anchor_at: str = "middle") -> None:
        parts.append(f'<text class="shape" x="{x}" y="{y}" text-anchor="{anchor_at}">'
                     f'{E(text)}</text>')

    if narrow:         # Q K side by side, the four boxes stacked, V beside the last, O below
        bx, bw, ys = 20, 190, [80, 190, 300, 410]
        io(14, 8, "Q", shape_str((n_q, d_k)))
        io(134, 8, "K", shape_str((n_k, d_k)))
        arrow("M62,52 C62,66 96,64 100,78")
        arrow("M182,52 C182,66 134,64 130,78")
        for (name, formula, step), y in zip(stages, ys, strict=True):
            box(bx, y, bw, name, formula, step)
        for a, b in zip(ys[:-1], ys[1:], strict=True):
            arrow(f"M115,{a + 72} L115,{b - 2}")
            shape(125, (a + 72 + b) / 2 + 4, qk, "start")
        io(236, 424, "V", shape_str((n_k, d_v)))
        arrow("M236,446 L212,446")
        io(67, 510, "O", shape_str((n_q, d_v)))
        arrow("M115,482 L115,508")
        if h > 1:
            parts.append(f'<text x="14" y="586">{E(t["page_per_head"].format(h=h))}</text>')
    else:
        io(8, 22, "Q", shape_str((n_q, d_k)))
        io(8, 104, "K", shape_str((n_k, d_k)))
        xs = [170, 390, 610, 830]
        for (name, formula, step), x in zip(stages, xs, strict=True):
            box(x, 48, 150, name, formula, step)
        arrow("M104,44 C136,44 140,70 166,74")
        arrow("M104,126 C136,126 140,100 166,96")
        for a, b in zip(xs[:-1], xs[1:], strict=True):
            arrow(f"M{a + 150},84 L{b - 2},84")
            shape((a + 150 + b) / 2, 76, qk)
        io(857, 142, "V", shape_str((n_k, d_v)))
        arrow("M905,142 L905,118")
        if h > 1:
            parts.append(f'<text x="170" y="160">{E(t["page_per_head"].format(h=h))}</text>')
        io(1004, 62, "O", shape_str((n_q, d_v)))
        arrow("M980,84 L1002,84")
    parts.append("</svg>")
    return "".join(parts)


def _color_legend(lang: str) -> str:
    """One line saying what the heatmap colours mean."""
    t = STRINGS[lang]

    def sw(bg: str, cls: str = "") -> str:
        return f'<span class="sw{cls}" style="background:{bg}"></span>'

    w0, w1 = cell_color(0.0, "weights", 1.0)[0], cell_color(1.0, "weights", 1.0)[0]
    neg, pos = cell_color(-1.0, "value", 1.0)[0], cell_color(1.0, "value", 1.0)[0]
    return (f'<div class="colors">{E(t["page_colors"])}: {E(t["page_c_weights"])} 0 '
            f'{sw(w0)}→{sw(w1)} 1'
            f'  ·  {E(t["page_c_other"])} − {sw(neg)}{sw("#ffffff")}{sw(pos)} +'
            f'  ·  <span class="sw x"></span> {E(t["page_c_masked"])}</div>')


def _step_table(trace: Trace, lang: str) -> str:
    """The five steps as a table; each cell carries its column's name (``data-label``), which
    a phone-width page shows when the rows become stacked cards (see CSS)."""
    t = check_lang(lang)
    heads = [t["step"], t["page_stage"], t["what"], t["formula"], t["shape"]]
    stage = {"scores": "page_stage_score", "scaled": "page_stage_scale_mask",
             "logits": "page_stage_scale_mask", "weights": "page_stage_softmax",
             "output": "page_stage_sum"}
    rows = []
    for i, s in enumerate(trace.steps):
        cells = [("n", f"{i + 1}. {step_name(s, lang)}"), ("st", t.get(stage.get(s.key, ""), "")),
                 ("w", step_what(s, lang)), ("f", step_formula(s, lang)),
                 ("f", shape_str(s.shape))]
        rows.append("<tr>" + "".join(f'<td class="{c}" data-label="{E(h)}">{E(v)}</td>'
                                     for (c, v), h in zip(cells, heads, strict=True)) + "</tr>")
    return ('<table class="steps"><thead><tr>' + "".join(f"<th>{E(h)}</th>" for h in heads)
            + "</tr></thead><tbody>" + "".join(rows) + "</tbody></table>")


def _card_head(title: str, shape: tuple[int, ...], t: dict[str, str], grid: int | None) -> str:
    """A card's title line: the name, the full shape, and the block size when drawn in blocks."""
    out = f'<h4>{title} <span class="shp">{shape_str(shape)}</span></h4>'
    if grid is not None and len(shape) == 2 and max(shape) > grid:
        fr, fc = block_sizes(shape, grid, grid)
        out += f'<div class="what">{E(t["page_block"].format(br=fr, bc=fc))}</div>'
    return out


def _section(trace: Trace, lang: str, idx: int, decimals: int) -> str:
    t = check_lang(lang)
    anchor = f"t{idx}"
    n_q, n_k = trace.scores.shape[-2:]
    ql = axis_labels(trace.q_labels, n_q, "q")
    kl = axis_labels(trace.k_labels, n_k, "k")
    dk = axis_labels("d", trace.q.shape[-1], "d")
    dv = axis_labels("d", trace.v.shape[-1], "d")
    grid = page_grid(trace)                    # None: every cell; else blocks (Caution)
    out = [f'<section class="trace" id="{anchor}">']
    title = trace.title.get(lang) or trace.title.get("en")
    if title:
        out.append(f"<h2>{E(title)}</h2>")
    intro = trace.intro.get(lang) or trace.intro.get("en")
    if intro:                   # the text's line breaks are the terminal's: let lines reflow
        intro = re.sub(r"(?<!\n)\n(?![\n ])", " ", intro)     # (indented lines stay lines)
        out.append(f'<div class="intro">{E(intro)}</div>')
    opts = [f"{t['scale_is']} = {fmt(trace.scale, decimals)}",
            f"{t['mask_is']}: {mask_label(trace.mask_name, lang)}"]
    if trace.softcap is not None:
        opts.append(f"{t['softcap_is']} = {fmt(trace.softcap, decimals)}")
    out.append(f'<div class="legend">{E(t["page_options"])}: {E("   ·   ".join(opts))}</div>')
    if grid is not None:
        out.append(f'<div class="legend pooled">{E(t["page_pooled"].format(g=grid))}</div>')
    out.append(f"<h3>{E(t['page_flow'])}</h3><div class=\"flow-wrap\">"
               + flow_svg(trace, lang, anchor) + flow_svg(trace, lang, anchor, narrow=True)
               + "</div>")
    out.append(f"<h3>{E(t['page_table'])}</h3><div class=\"steps-wrap\">"
               + _step_table(trace, lang) + "</div>")
    n_heads = n_matrices(trace.scores)
    heads = split_heads(trace.scores, lang, limit=MAX_HEADS)
    many = n_heads > 1
    if many:
        out.append('<div class="tabs" role="tablist">' + "".join(
            f'<button type="button" data-head="{h}"{" class=on" if h == 0 else ""}>'
            f"{E(label)}</button>" for h, (label, _) in enumerate(heads)) + "</div>")
    if n_heads > len(heads):
        out.append(f'<div class="legend">'
                   f'{E(t["page_more_heads"].format(n=n_heads - len(heads), m=len(heads)))}'
                   "</div>")

    def flat(a: np.ndarray) -> np.ndarray:
        return a.reshape(n_matrices(a), *a.shape[-2:])          # (heads, rows, cols), a view

    inputs = [flat(trace.q), flat(trace.k), flat(trace.v)]
    values = [flat(s.value) for s in trace.steps]
    for h in range(len(heads)):
        hidden = " hidden" if h > 0 else ""
        out.append(f'<div class="head" data-head="{h}"{hidden}>')
        out.append(f"<h3>{E(t['inputs'])}</h3><div class=\"grid\">")
        for name, mats, rows in (("Q", inputs[0], ql), ("K", inputs[1], kl),
                                 ("V", inputs[2], kl)):
            j = kv_head_index(trace, h) if name != "Q" else h
            m = mats[j]
            cols = dv if name == "V" else dk
            if name != "Q" and len(mats) != n_heads:          # GQA / MQA: a shared K/V head
                name = f"{name} · {head_label(trace.k.shape[:-2], j, lang, 'kv_head')}"
            out.append('<div class="card">' + _card_head(name, m.shape, t, grid)
                       + heatmap(m, rows, cols, 'input', name, decimals, grid=grid) + "</div>")
        out.append("</div><h3>" + E(t["rows_cols"]) + "</h3>" + _color_legend(lang)
                   + '<div class="grid">')
        for i, s in enumerate(trace.steps):
            m = values[i][h]
            cols = dv if s.key == "output" else kl
            kind = "weights" if s.key == "weights" else "value"
            out.append(
                f'<div class="card" id="{anchor}-s{i + 1}" data-key="{s.key}">'
                + _card_head(f"{i + 1}. {E(step_name(s, lang))}", m.shape, t, grid)
                + f'<div class="what">{E(step_what(s, lang))}</div>'
                f'<div class="f">{E(step_formula(s, lang))}</div>'
                + heatmap(m, ql, cols, kind, f"{i + 1}. {step_name(s, lang)}", decimals,
                          sums=s.key == "weights", grid=grid) + "</div>")
        out.append("</div></div>")
    if trace.output.ndim == 3 and trace.output.shape[0] > 1:
        hh, nq, d = trace.output.shape
        cat = trace.output.transpose(1, 0, 2).reshape(nq, hh * d)
        cols = axis_labels("d", hh * d, "d")
        out.append(f'<h3>{E(t["page_concat"])}</h3><div class="card" id="{anchor}-concat">'
                   + _card_head(E(step_name("Concat", lang)), cat.shape, t, grid)
                   + f'<div class="what">{E(t["Concat"])}</div>'
                   '<div class="f">O = [O₁ | … | O_h]</div>'
                   + heatmap(cat, ql, cols, "value", step_name("Concat", lang), decimals,
                             grid=grid)
                   + "</div>")
    notes = remarks(trace, lang, decimals)
    if notes:
        out.append(f'<h3>{E(t["remarks"])}</h3><ul class="notes">'
                   + "".join(f"<li>{E(n.strip())}</li>" for n in notes) + "</ul>")
    out.append(playground(trace, lang, idx, decimals))
    out.append("</section>")
    return "".join(out)


def section_html(trace: Trace, lang: str = "en", idx: int = 0, decimals: int = 3) -> str:
    """One trace's section of the page (for pages that embed a trace, e.g. a model's head)."""
    return _section(trace, lang, idx, check_decimals(decimals))


def render_html(traces: Trace | Sequence[Trace], lang: str = "en", decimals: int = 3) -> str:
    """The page for one trace or several (an example and its comparisons), as a string."""
    t = check_lang(lang)
    decimals = check_decimals(decimals)
    if not isinstance(traces, Sequence):
        traces = [traces]
    first = traces[0].title.get(lang) or traces[0].title.get("en") if traces else None
    title = f"{t['page_doc_title']} — {first}" if first else t["page_doc_title"]
    body = "".join(_section(tr, lang, i, decimals) for i, tr in enumerate(traces))
    return (
        f'<!doctype html><html lang="{lang}"><head><meta charset="utf-8">{GENERATOR_META}'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{E(title)}</title><style>{CSS}{PLAY_CSS}</style>"
        f"<script>{ERROR_HOOK}</script></head>"
        f"<body><main><header><h1>{E(t['page_doc_title'])}</h1>"
        f'<div class="formula">{FORMULA_HTML}</div>'
        f'<div class="legend">{E(t["page_legend"])}</div></header>{body}'
        f'<pre id="js-errors" hidden></pre><footer>{E(t["page_generated"])}</footer></main>'
        f'<div id="tip"></div><script>{PLAY_JS}</script><script>{JS}</script></body></html>\n'
    )
