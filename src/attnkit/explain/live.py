"""The page's playground: edit Q, K, V, move the scale, change the mask — and watch every step.

One playground per trace (for a multi-head trace: its first head), inside the same
self-contained page. The page's own script recomputes the five steps on every change —
S = Q Kᵀ, X = S · scale (then the soft-cap), L = X + M, W = softmax(L) with its row sums,
O = W V — with the formulas of :mod:`attnkit.reference` in float64 (JavaScript numbers), and
prints them with the same rules as :func:`~attnkit.explain.common.fmt` and
:func:`~attnkit.explain.common.cell_formatter`, so the page shows the digits
``attnkit.explain`` would print for the same inputs.

Controls (all keyboard-usable: Tab to reach, arrows on the slider, Enter/Space on a cell):

    the logit multiplier ×f   scale = f · (the trace's scale); f = 10 is the course's "×10"
    the mask                  none / causal (query i sees keys 1..i) / padding (first L keys)
    a cell of M               click (or Enter) to block / unblock that one key for that query
    Q, K, V cells             text fields; a value that is not a number is marked, not used
    wide rows (> INLINE)      one strip per row, a colour per feature: tap / click a feature
                              (or ←/→/Home/End on a focused strip) to pick it, then edit it
                              in the one field under the inputs; a wide O is strips too

Shape legend::

    Q (n_q, d_k)  K (n_k, d_k)  V (n_k, d_v)  S, X, M, L, W (n_q, n_k)  O (n_q, d_v)

Caution
-------
- Offered only where the page can recompute the trace itself: at most
  :data:`MAX_SIDE` queries and keys, at most :data:`MAX_FEATURES` features (d_k, d_v),
  finite inputs, no ``score_mod`` and no float bias; other traces get a one-line note
  instead. Up to :data:`INLINE` features a row is a row of text fields; a wider row is one
  ``<canvas>`` strip, so the page's size does not grow with d (16 queries × 512 features
  are the same few hundred elements as 16 × 17), and the one edit field serves every strip.
  The playground starts from the trace's inputs and mask (a causal trace starts in
  "causal" mode; any other mask as blocked cells).
- Ties in the last digit (an exact binary x.xxx5) may round the other way in JavaScript
  than in Python; every other value prints the same.
"""

from __future__ import annotations

import html
import json
from typing import TYPE_CHECKING

import numpy as np

from .common import NEG_RGB, POS_RGB, WEIGHTS_RGB, axis_labels, kv_head_index
from .strings import check_lang, step_name

if TYPE_CHECKING:
    from .trace import Trace

__all__ = ["playground", "playable", "MAX_SIDE", "MAX_FEATURES", "INLINE", "CSS", "JS"]

MAX_SIDE = 16          # queries, keys: the step tables are n_q × n_k cells
MAX_FEATURES = 512     # d_k, d_v: each row is one canvas strip above INLINE
INLINE = 16            # up to this many features a row is a row of text fields
E = html.escape


CSS = """
section.play{border-top:1px dashed var(--line);margin-top:14px;padding-top:6px}
.pl-controls{display:flex;flex-wrap:wrap;gap:8px 18px;align-items:center;margin:6px 0 10px}
.pl-controls label{display:inline-flex;gap:6px;align-items:center}
.pl-controls input[type=range]{width:180px}
.pl-controls output,.pl-scale{font-family:ui-monospace,monospace}
table.pl{border-collapse:separate;border-spacing:1px;font:12px ui-monospace,monospace;
 margin-top:6px}
table.pl th{font-weight:600;color:var(--mute);padding:1px 5px;white-space:nowrap}
table.pl td{min-width:44px;height:24px;text-align:center;padding:0 4px;border-radius:3px}
table.pl td.sum{color:var(--mute);border-left:2px solid var(--line)}
table.pl td.x{background:repeating-linear-gradient(45deg,#e6e8ee 0 4px,#f6f7fa 4px 8px);
 color:#8a93a5}
table.pl input{width:64px;font:12px ui-monospace,monospace;padding:2px 3px;
 border:1px solid var(--line);border-radius:3px}
table.pl input.bad{border-color:#b00020;background:#fde8eb}
table.pl button.pl-cell{min-width:40px;font:12px ui-monospace,monospace;border:1px solid
 var(--line);border-radius:3px;background:#fff;cursor:pointer;padding:2px 4px}
table.pl button.pl-cell.off{background:repeating-linear-gradient(45deg,#e6e8ee 0 4px,
 #f6f7fa 4px 8px);color:#8a93a5}
table.pl button.pl-cell:focus-visible,table.pl input:focus-visible{outline:2px solid var(--acc)}
.pl-scroll{max-width:100%;overflow-x:auto}
.pl-vecs{display:flex;flex-direction:column;gap:3px;margin-top:6px;min-width:0}
.pl-vrow{display:flex;align-items:center;gap:6px;min-width:0}
.pl-lab{flex:0 0 5em;width:5em;overflow:hidden;text-overflow:ellipsis;
 white-space:nowrap;font:600 12px ui-monospace,monospace;color:var(--mute);text-align:right}
canvas.pl-vec{flex:0 1 auto;min-width:24px;height:18px;border:1px solid var(--line);
 border-radius:3px;image-rendering:pixelated;cursor:crosshair}
canvas.pl-vec:focus-visible{outline:2px solid var(--acc)}
.card.pl-wide{flex:1 1 300px;min-width:0}
.pl-edit{display:flex;flex-wrap:wrap;gap:6px 12px;align-items:center;margin:8px 0 4px;
 font:13px ui-monospace,monospace}
.pl-edit input{width:140px;font:13px ui-monospace,monospace;padding:2px 4px;
 border:1px solid var(--line);border-radius:3px}
.pl-edit input.bad{border-color:#b00020;background:#fde8eb}
.pl-edit .what{flex:1 1 100%;font:13px/1.5 system-ui,sans-serif}
.pl-peek{color:var(--mute)}
"""

JS = r"""
(function(){
  function fixed(x,d){var s=x.toFixed(d); return s;}
  function expo(x,d){var s=x.toExponential(d);
    return s.replace(/e([+-])(\d)$/,'e$10$2');}
  function fmt(x,d){
    if(isNaN(x)) return 'nan';
    if(!isFinite(x)) return x<0?'-inf':'inf';
    if(x===0) return '0';
    var a=Math.abs(x);
    if(a>=1e6) return expo(x,d);
    if(a>=0.5 && Math.abs(x-Math.round(x))<1e-9*Math.max(1,a)) x=Math.round(x);
    for(var k=d;k<d+4;k++){var s=fixed(x,k), r=Math.abs(parseFloat(s));
      if((r!==0&&r!==1)||Math.abs(x)===1) return s;}
    if(Math.abs(x)<1) return expo(x,1);
    return fixed(x,d);
  }
  function formatter(m,d){
    var whole=false, any=false, ok=true;
    m.forEach(function(r){r.forEach(function(v){ if(isFinite(v)){any=true;
      if(v!==Math.round(v)||Math.abs(v)>=1e6) ok=false;}});});
    whole=any&&ok;
    return function(v){ return (whole&&isFinite(v))? String(Math.round(v)) : fmt(v,d); };
  }
  function hex(c){return '#'+c.map(function(x){var n=Math.round(255*Math.min(Math.max(x,0),1));
    return (n<16?'0':'')+n.toString(16);}).join('');}
  function mix(a,b,t){return [a[0]+(b[0]-a[0])*t,a[1]+(b[1]-a[1])*t,a[2]+(b[2]-a[2])*t];}
    var WHITE=[1,1,1], POS, NEG, WT;
  function color(v,kind,vmax){
    if(kind==='weights'){var t=Math.pow(Math.min(Math.max(v,0),1),0.8);
      return [hex(mix(WHITE,WT,t)),t>0.5];}
    var u=vmax>0?Math.min(Math.abs(v)/vmax,1):0;
    return [hex(mix(WHITE,v>=0?POS:NEG,u*0.9)),u>0.55];
  }
  function rgb(v,vmax){var u=vmax>0?Math.min(Math.abs(v)/vmax,1):0;
    return mix(WHITE,v>=0?POS:NEG,u*0.9).map(function(x){
      return Math.round(255*Math.min(Math.max(x,0),1));});}
  function absmax(m){var a=0; m.forEach(function(r){r.forEach(function(v){
    if(isFinite(v)&&Math.abs(v)>a) a=Math.abs(v);});}); return a;}
  // one row as a strip: a column of pixels per feature (4 high); the picked feature gets a
  // dark tick at the top and the bottom
  function strip(cv,row,vmax,pick){
    var d=row.length, ctx=cv.getContext('2d'), img=ctx.createImageData(d,4), p=img.data;
    for(var t=0;t<d;t++){var c=rgb(row[t],vmax);
      for(var y=0;y<4;y++){var o=(y*d+t)*4; p[o]=c[0];p[o+1]=c[1];p[o+2]=c[2];p[o+3]=255;}}
    if(pick>=0){var w=Math.max(1,Math.round(d/96));
      for(t=Math.max(0,pick-(w>>1));t<Math.min(d,pick-(w>>1)+w);t++){
        [0,3].forEach(function(y){var o=(y*d+t)*4; p[o]=17;p[o+1]=17;p[o+2]=17;});}}
    ctx.putImageData(img,0,0);
  }
  function zeros(n,m){var a=[];for(var i=0;i<n;i++){a.push(new Array(m).fill(0));}return a;}
  function compute(st){
    var D=st.d, nq=D.q.length, nk=D.k.length, dk=D.k[0]?D.k[0].length:0,
        dv=D.v[0]?D.v[0].length:0, scale=D.base*st.factor;
    var S=zeros(nq,nk), X=zeros(nq,nk), M=zeros(nq,nk), L=zeros(nq,nk), W=zeros(nq,nk),
        O=zeros(nq,dv), sums=new Array(nq).fill(0), A=[];
    for(var i=0;i<nq;i++){A.push([]);
      for(var j=0;j<nk;j++){
        var s=0; for(var t=0;t<dk;t++){s+=st.q[i][t]*st.k[j][t];}
        S[i][j]=s; var x=s*scale;
        if(D.softcap!==null){x=D.softcap*Math.tanh(x/D.softcap);}
        X[i][j]=x;
        var ok=!st.blocked[i][j];
        if(st.mode==='causal'&&j>i) ok=false;
        if(st.mode==='padding'&&j>=st.pad) ok=false;
        A[i].push(ok); M[i][j]=ok?0:-Infinity; L[i][j]=ok?x:-Infinity;
      }
      var mx=-Infinity; for(j=0;j<nk;j++){if(L[i][j]>mx) mx=L[i][j];}
      if(mx===-Infinity){continue;}                 // no allowed key: weights 0, output 0
      var z=0, e=new Array(nk);
      for(j=0;j<nk;j++){e[j]=A[i][j]?Math.exp(L[i][j]-mx):0; z+=e[j];}
      for(j=0;j<nk;j++){W[i][j]=e[j]/z; sums[i]+=W[i][j];}
      for(t=0;t<dv;t++){var o=0; for(j=0;j<nk;j++){o+=W[i][j]*st.v[j][t];} O[i][t]=o;}
    }
    return {scale:scale,scores:S,scaled:X,mask:M,logits:L,weights:W,output:O,sums:sums,allowed:A};
  }
  function fill(table,m,kind,dec,sums){
    var f=formatter(m,dec), vmax=0, rows=table.tBodies[0].rows;
    m.forEach(function(r){r.forEach(function(v){
      if(isFinite(v)&&Math.abs(v)>vmax) vmax=Math.abs(v);});});
    for(var i=0;i<m.length;i++){var cells=rows[i].cells;
      for(var j=0;j<m[i].length;j++){var td=cells[j+1], v=m[i][j], s=f(v);
        td.setAttribute('data-v', v===-Infinity?'-inf':s);
        if(v===-Infinity){td.className='x';td.textContent='\u2212\u221e';td.style.cssText='';continue;}
        var c=color(v,kind,vmax); td.className='';
        td.style.background=c[0]; td.style.color=c[1]?'#fff':'';
        td.textContent=s;}
      if(sums){var sd=cells[m[i].length+1]; sd.textContent=fmt(sums[i],dec);
        sd.setAttribute('data-v',sd.textContent);}
    }
  }
  document.querySelectorAll('section.play').forEach(function(sec){
    var D=JSON.parse(sec.querySelector('script.pl-data').textContent);
    POS=D.pos; NEG=D.neg; WT=D.wt;
    function fresh(){return {d:D,factor:1,mode:D.mode,pad:D.k.length,
      q:D.q.map(function(r){return r.slice();}),k:D.k.map(function(r){return r.slice();}),
      v:D.v.map(function(r){return r.slice();}),
      blocked:D.blocked.map(function(r){return r.slice();})};}
    var st=fresh();
    var fac=sec.querySelector('.pl-factor'), facv=sec.querySelector('.pl-factor-v'),
        mode=sec.querySelector('.pl-mode'), pad=sec.querySelector('.pl-pad'),
        scl=sec.querySelector('.pl-scale');
    var edIn=sec.querySelector('.pl-edit-in'), edAt=sec.querySelector('.pl-edit-at'),
        peek=sec.querySelector('.pl-peek');
    function where(m,i,j){var w={m:m.toUpperCase(),r:D.rows[m][i],c:'d'+(j+1)};
      return D.at.replace(/\{([mrc])\}/g,function(_,x){return w[x];});}
    function strips(){          // the wide inputs, each row one strip (the pick ticked)
      var vm={};
      sec.querySelectorAll('canvas.pl-vec[data-m]').forEach(function(cv){
        var m=cv.getAttribute('data-m'), i=+cv.getAttribute('data-i');
        if(!(m in vm)) vm[m]=absmax(st[m]);
        strip(cv,st[m][i],vm[m],st.pick&&st.pick.m===m&&st.pick.i===i?st.pick.j:-1);});
    }
    function pick(m,i,j){
      var d=st[m][i].length; j=Math.max(0,Math.min(j,d-1));
      st.pick={m:m,i:i,j:j}; edAt.textContent=where(m,i,j);
      edIn.value=String(st[m][i][j]); edIn.classList.remove('bad');
      edIn.setAttribute('aria-label',where(m,i,j)); strips();
    }
    function wideOut(r){        // a wide O: strips, the printed values in each row's data-v
      var box=sec.querySelector('[data-pl-vec="output"]'); if(!box) return;
      var f=formatter(r.output,D.dec), vm=absmax(r.output);
      box.querySelectorAll('.pl-vrow').forEach(function(row,i){
        row.setAttribute('data-v',r.output[i].map(f).join(' '));
        strip(row.querySelector('canvas'),r.output[i],vm,-1);});
    }
    function render(){
      var r=compute(st); sec.__result=r;
      facv.textContent='\u00d7'+st.factor.toFixed(1);
      scl.textContent='scale = '+fmt(r.scale,D.dec); scl.setAttribute('data-v',fmt(r.scale,D.dec));
      ['scores','scaled','logits','weights','output'].forEach(function(key){
        var t=sec.querySelector('table[data-pl="'+key+'"]'); if(!t) return;
        fill(t,r[key],key==='weights'?'weights':'value',D.dec,key==='weights'?r.sums:null);});
      wideOut(r); if(edIn) strips();
      sec.querySelectorAll('button.pl-cell').forEach(function(b){
        var i=+b.getAttribute('data-i'), j=+b.getAttribute('data-j'), ok=r.allowed[i][j];
        b.textContent=ok?'0':'\u2212\u221e'; b.classList.toggle('off',!ok);
        b.setAttribute('data-v',ok?'0':'-inf');
        b.setAttribute('aria-pressed',st.blocked[i][j]?'true':'false');});
      pad.disabled=st.mode!=='padding';
      sec.setAttribute('data-state',JSON.stringify({factor:st.factor,mode:st.mode,pad:st.pad}));
    }
    function syncInputs(){
      sec.querySelectorAll('input.pl-in').forEach(function(inp){
        var m=inp.getAttribute('data-m'), i=+inp.getAttribute('data-i'),
            j=+inp.getAttribute('data-j');
        inp.value=String(st[m][i][j]); inp.classList.remove('bad');});
      fac.value='1'; mode.value=st.mode; pad.value=String(st.pad);
      if(edIn){var p0=st.pick||D.pick; pick(p0.m,p0.i,p0.j);}
    }
    fac.addEventListener('input',function(){st.factor=parseFloat(fac.value); render();});
    mode.addEventListener('change',function(){st.mode=mode.value; render();});
    pad.addEventListener('input',function(){var n=parseInt(pad.value,10);
      if(!isNaN(n)){st.pad=Math.max(0,Math.min(n,D.k.length)); render();}});
    sec.querySelectorAll('input.pl-in').forEach(function(inp){
      inp.addEventListener('input',function(){
        var s=inp.value.trim().replace('\u2212','-'), x=Number(s);
        if(s===''||!isFinite(x)){inp.classList.add('bad');return;}
        inp.classList.remove('bad');
        st[inp.getAttribute('data-m')][+inp.getAttribute('data-i')][+inp.getAttribute('data-j')]=x;
        render();});
    });
    sec.querySelectorAll('button.pl-cell').forEach(function(b){
      b.addEventListener('click',function(){
        var i=+b.getAttribute('data-i'), j=+b.getAttribute('data-j');
        st.blocked[i][j]=!st.blocked[i][j]; render();});
    });
    if(edIn){
      sec.querySelectorAll('canvas.pl-vec[data-m]').forEach(function(cv){
        var m=cv.getAttribute('data-m'), i=+cv.getAttribute('data-i');
        function at(ev){var b=cv.getBoundingClientRect();
          return Math.floor((ev.clientX-b.left)/b.width*st[m][i].length);}
        cv.addEventListener('click',function(ev){pick(m,i,at(ev));});
        cv.addEventListener('mousemove',function(ev){
          var j=Math.max(0,Math.min(at(ev),st[m][i].length-1));
          peek.textContent=where(m,i,j)+' = '+fmt(st[m][i][j],D.dec);});
        cv.addEventListener('mouseleave',function(){peek.textContent='';});
        cv.addEventListener('focus',function(){
          if(!st.pick||st.pick.m!==m||st.pick.i!==i) pick(m,i,st.pick?st.pick.j:0);});
        cv.addEventListener('keydown',function(ev){
          var j=st.pick.j, d=st[m][i].length, k=ev.key;
          if(k==='ArrowRight') j++; else if(k==='ArrowLeft') j--;
          else if(k==='Home') j=0; else if(k==='End') j=d-1;
          else if(k==='Enter'){ev.preventDefault(); edIn.focus(); edIn.select(); return;}
          else return;
          ev.preventDefault(); pick(m,i,j);});
      });
      edIn.addEventListener('input',function(){
        var s=edIn.value.trim().replace('\u2212','-'), x=Number(s), p=st.pick;
        if(s===''||!isFinite(x)){edIn.classList.add('bad');return;}
        edIn.classList.remove('bad'); st[p.m][p.i][p.j]=x; render();});
      pick(D.pick.m,D.pick.i,D.pick.j);
    }
    sec.querySelector('.pl-reset').addEventListener('click',function(){
      st=fresh(); syncInputs(); render();});
    render();
    sec.setAttribute('data-ready','1');
  });
})();
"""


def playable(trace: Trace) -> bool:
    """Can the page recompute this trace itself (small, no score_mod, no float bias)?"""
    if trace.has_score_mod or trace.has_bias:
        return False
    n_q, n_k = trace.scores.shape[-2:]
    d_k, d_v = trace.q.shape[-1], trace.v.shape[-1]
    return (max(n_q, n_k) <= MAX_SIDE and max(d_k, d_v) <= MAX_FEATURES
            and min(n_q, n_k, d_k, d_v) > 0 and trace.scores.size > 0
            and all(bool(np.isfinite(a).all()) for a in (trace.q, trace.k, trace.v)))


def _first(a: np.ndarray, h: int = 0) -> np.ndarray:
    return a.reshape(-1, *a.shape[-2:])[h]                     # (rows, cols) of flat head h


def _table(key: str, rows: list[str], cols: list[str], sums: bool) -> str:
    """An empty matrix the script fills: one <td> per value (and Σ for the weights)."""
    head = "".join(f"<th>{E(c)}</th>" for c in cols) + ("<th>Σ</th>" if sums else "")
    body = "".join(f'<tr><th>{E(r)}</th>{"<td></td>" * len(cols)}'
                   f'{"<td class=sum></td>" if sums else ""}</tr>' for r in rows)
    return (f'<table class="pl" data-pl="{key}"><thead><tr><th></th>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table>")


def _strips(key: str, rows: list[str], d: int, title: str, help_text: str | None,
            editable: bool, lang: str) -> str:
    """A wide matrix, one ``<canvas>`` strip per row (the script draws them): a constant
    number of elements per row whatever d is. Editable strips carry ``data-m``."""
    t = check_lang(lang)
    width = min(max(4 * d, 160), 420)                         # CSS px; pixelated
    body = []
    for i, r in enumerate(rows):
        attrs = (f' data-m="{key}" data-i="{i}" tabindex="0" aria-label="'
                 f'{E(t["play_strip"].format(m=key.upper(), r=r, d=d))}"' if editable
                 else ' aria-hidden="true"')
        body.append(f'<div class="pl-vrow" data-i="{i}"><span class="pl-lab">{E(r)}</span>'
                    f'<canvas class="pl-vec" width="{d}" height="4" '
                    f'style="width:{width}px"{attrs}></canvas></div>')
    return (f'<div class="card pl-wide" data-pl-vec="{key}"><h4>{title} '
            f'<span class="shp">({len(rows)} × {d})</span></h4>'
            + (f'<div class="f">{E(help_text)}</div>' if help_text else "")
            + f'<div class="pl-vecs">{"".join(body)}</div></div>')


def _inputs(name: str, m: np.ndarray, rows: list[str], cols: list[str], lang: str) -> str:
    t = check_lang(lang)
    key = name.lower()
    if m.shape[1] > INLINE:                                    # wide: strips, one edit field
        return _strips(key, rows, m.shape[1], name, None, True, lang)
    head = "".join(f"<th>{E(c)}</th>" for c in cols)
    body = []
    for i, r in enumerate(rows):
        cells = "".join(
            f'<td><input class="pl-in" data-m="{key}" data-i="{i}" data-j="{j}" '
            f'inputmode="decimal" value="{float(m[i, j])!r}" '
            f'aria-label="{E(t["play_cell"].format(m=name, r=r, c=cols[j]))}"></td>'
            for j in range(m.shape[1]))
        body.append(f"<tr><th>{E(r)}</th>{cells}</tr>")
    return (f'<div class="card"><h4>{name}</h4><table class="pl" data-pl-in="{key}"><thead>'
            f'<tr><th></th>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>')


def _mask_cells(rows: list[str], cols: list[str], lang: str) -> str:
    t = check_lang(lang)
    head = "".join(f"<th>{E(c)}</th>" for c in cols)
    body = "".join(
        f"<tr><th>{E(r)}</th>" + "".join(
            f'<td><button type="button" class="pl-cell" data-i="{i}" data-j="{j}" '
            f'aria-label="{E(t["play_block_cell"].format(r=r, c=c))}">0</button></td>'
            for j, c in enumerate(cols)) + "</tr>"
        for i, r in enumerate(rows))
    return (f'<table class="pl" data-pl="mask"><thead><tr><th></th>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table>")


def playground(trace: Trace, lang: str, idx: int, decimals: int = 3) -> str:
    """The playground section of trace ``idx`` (or a one-line note when it cannot have one)."""
    t = check_lang(lang)
    if not playable(trace):
        return (f'<p class="legend">{E(t["play_none"].format(n=MAX_SIDE, f=MAX_FEATURES))}'
                "</p>")
    q = _first(trace.q)                                        # (n_q, d_k)
    kh = kv_head_index(trace, 0) if trace.k.ndim > 2 else 0
    k, v = _first(trace.k, kh), _first(trace.v, kh)            # (n_k, d_k), (n_k, d_v)
    allowed = _first(trace.allowed)                            # (n_q, n_k)
    n_q, n_k = allowed.shape
    causal = bool(trace.options.get("is_causal"))
    blocked = np.zeros_like(allowed) if causal else ~allowed    # (n_q, n_k) cells blocked
    data = {"q": q.tolist(), "k": k.tolist(), "v": v.tolist(), "base": float(trace.scale),
            "softcap": None if trace.softcap is None else float(trace.softcap),
            "blocked": blocked.tolist(), "mode": "causal" if causal else "none",
            "dec": int(decimals), "pos": list(POS_RGB), "neg": list(NEG_RGB),
            "wt": list(WEIGHTS_RGB)}
    ql = axis_labels(trace.q_labels, n_q, "q")
    kl = axis_labels(trace.k_labels, n_k, "k")
    dk = axis_labels("d", q.shape[-1], "d")
    dv = axis_labels("d", v.shape[-1], "d")
    wide = [m for m, a in (("q", q), ("k", k), ("v", v)) if a.shape[-1] > INLINE]
    if wide:                   # the edit field's label, and what it starts on
        data.update(rows={"q": ql, "k": kl, "v": kl}, at=t["play_edit_at"],
                    pick={"m": wide[0], "i": 0, "j": 0})
    blob = json.dumps(data, allow_nan=False).replace("</", "<\\/")
    many = trace.scores.ndim > 2 and int(np.prod(trace.scores.shape[:-2])) > 1
    head_note = f' <span class="what">{E(t["play_first_head"])}</span>' if many else ""
    opts = "".join(f'<option value="{m}">{E(t["play_mode_" + m])}</option>'
                   for m in ("none", "causal", "padding"))
    cards = []
    for i, (key, step) in enumerate((("scores", "scores"), ("scaled", "scaled"),
                                     ("logits", "logits"), ("weights", "weights"),
                                     ("output", "output"))):
        s = trace.step(step)
        if key == "output" and v.shape[-1] > INLINE:          # a wide O: strips too
            cards.append(_strips("output", ql, v.shape[-1], f"{i + 1}. "
                                 f"{E(step_name(s, lang))}", t["play_f_output"], False, lang)
                         .replace('class="card pl-wide"',
                                  'class="card pl-wide" data-pl-card="output"', 1))
            continue
        cards.append(f'<div class="card" data-pl-card="{key}"><h4>{i + 1}. '
                     f"{E(step_name(s, lang))}</h4>"
                     f'<div class="f">{E(t["play_f_" + key])}</div>'
                     + _table(key, ql, dv if key == "output" else kl, key == "weights")
                     + "</div>")
    edit = (f'<div class="pl-edit"><div class="what">{E(t["play_wide"])}</div>'
            '<label><span class="pl-edit-at"></span> = '
            '<input class="pl-edit-in" inputmode="decimal"></label>'
            '<span class="pl-peek" aria-live="polite"></span></div>' if wide else "")
    return (
        f'<section class="play" id="play{idx}"><h3>{E(t["play_title"])}{head_note}</h3>'
        f'<p class="what">{E(t["play_help"])}</p>'
        '<div class="pl-controls">'
        f'<label>{E(t["play_factor"])} <input type="range" class="pl-factor" min="0" '
        f'max="10" step="0.1" value="1" aria-label="{E(t["play_factor"])}">'
        '<output class="pl-factor-v">×1.0</output></label>'
        '<span class="pl-scale"></span>'
        f'<label>{E(t["mask_is"])} <select class="pl-mode">{opts}</select></label>'
        f'<label>{E(t["play_pad"])} <input type="number" class="pl-pad" min="0" '
        f'max="{n_k}" value="{n_k}"></label>'
        f'<button type="button" class="pl-reset">{E(t["play_reset"])}</button></div>'
        f'<h3>{E(t["inputs"])}</h3><div class="grid">'
        + _inputs("Q", q, ql, dk, lang) + _inputs("K", k, kl, dk, lang)
        + _inputs("V", v, kl, dv, lang) + "</div>" + edit
        + f'<h3>{E(t["play_mask"])}</h3><div class="what">{E(t["play_mask_help"])}</div>'
        + '<div class="pl-scroll">' + _mask_cells(ql, kl, lang) + "</div>"
        + f'<h3>{E(t["rows_cols"])}</h3><div class="grid">' + "".join(cards) + "</div>"
        f'<script type="application/json" class="pl-data">{blob}</script></section>'
    )
