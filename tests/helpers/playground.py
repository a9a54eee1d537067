"""Reading the explain page's playground back (selenium) and checking every number it shows
against ``ak.explain`` on the same inputs, printed by the same rules (``cell_formatter``,
``fmt``): shared by test_live.py and test_wide_playground.py."""

from __future__ import annotations

import numpy as np
import torch

import attnkit as ak
from attnkit.explain.common import cell_formatter, fmt

READ = """
var sec=document.querySelector(arguments[0]); var out={};
sec.querySelectorAll('table[data-pl]').forEach(function(t){
  out[t.getAttribute('data-pl')]=[].map.call(t.tBodies[0].rows,function(r){
    return [].map.call(r.querySelectorAll('td'),function(td){
      var b=td.querySelector('button'); return (b||td).getAttribute('data-v');});});});
out.state=JSON.parse(sec.getAttribute('data-state'));
out.scale=sec.querySelector('.pl-scale').getAttribute('data-v');
out.q=[].map.call(sec.querySelectorAll('input.pl-in[data-m="q"]'),function(i){return i.value;});
return out;
"""


def _same(shown: str, want: str) -> bool:
    """Equal as printed; a last-digit tie may round the other way in JavaScript (Caution)."""
    if shown == want:
        return True
    try:
        a, b = float(shown), float(want)
    except ValueError:
        return False
    digits = len(want.split(".")[1]) if "." in want else 0
    return abs(a - b) <= 1.01 * 10.0 ** -digits


def check_page(page: dict, q, k, v, allowed, scale, softcap=None) -> None:
    tr = ak.explain(q, k, v, mask=torch.tensor(allowed), scale=scale, softcap=softcap)
    assert page["scale"] == fmt(scale)
    for key in ("scores", "scaled", "logits", "weights", "output"):
        m = tr.step(key).value
        f = cell_formatter(m)
        shown = [row[:m.shape[1]] for row in page[key]]
        want = [["-inf" if x == -np.inf else f(float(x)) for x in row] for row in m]
        bad = [(i, j, shown[i][j], want[i][j]) for i in range(m.shape[0])
               for j in range(m.shape[1]) if not _same(shown[i][j], want[i][j])]
        assert not bad, f"{key}: (row, col, page, python) {bad}"
    sums = [row[-1] for row in page["weights"]]
    assert sums == [fmt(float(s)) for s in tr.weights.sum(-1)]
    assert page["mask"] == [["0" if a else "-inf" for a in row] for row in allowed]
