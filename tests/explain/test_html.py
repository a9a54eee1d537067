"""The HTML page: self-contained, complete, and working in a real (headless) Chromium.

The browser tests need Debian's chromium and chromium-driver (``.ci/setup-system`` installs
them) and selenium (requirements-dev.txt); they skip only where chromium is absent. They share
one driver (``browser``: helpers.webpage.shared_driver).
"""

from __future__ import annotations

import io
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import attnkit as ak
from attnkit.explain.common import fmt
from attnkit.explain.examples import EXAMPLES
from attnkit.explain.html import render_html
from helpers.webpage import FLAGS, find_chromium, needs_chromium


def cells(page: str, step: str) -> list[list[str]]:
    """The data-v values of the first heatmap whose data-step starts with ``step``."""
    m = re.search(r'<table class="hm[^"]*" data-step="' + re.escape(step) + r'[^"]*">(.*?)</table>',
                  page)
    assert m, step
    return [re.findall(r'data-v="([^"]+)"', r) for r in re.findall(r"<tr>(.*?)</tr>",
                                                                    m.group(1))[1:]]


# ---------------------------------------------------------------------------- the page


def test_page_is_self_contained():
    page = render_html(EXAMPLES["masked"].traces())
    assert page.startswith("<!doctype html>")
    assert not re.search(r"https?://|<link|\bsrc=|@import|url\((?!#)", page)


def test_page_shows_flow_formula_steps_and_values():
    tr = EXAMPLES["worked"].build()
    page = render_html([tr])
    for text in ("Score", "Scale &amp; Mask", "Softmax", "Weighted sum", "O = W V",
                 "softmax( Q K<sup>T</sup>", "S = Q Kᵀ", "W = softmax_keys(L)"):
        assert text in page, text
    # the shapes on the arrows of the flow
    flow = page[page.index('<svg class="flow"'):page.index("</svg>")]
    assert flow.count(">(1, 3)<") == 3 and ">(1, 4)<" in flow and ">(1, 2)<" in flow
    # every step's heatmap holds every value
    assert cells(page, "4.") == [[fmt(float(x)) for x in tr.weights[0]]]
    assert cells(page, "1.") == [["2", "0", "1"]]          # whole numbers print as integers
    np.testing.assert_allclose(np.array(cells(page, "5."), dtype=float), tr.output, atol=5e-4)


def test_masked_cells_are_marked():
    page = render_html(EXAMPLES["causal"].traces())
    logits = cells(page, "3.")
    assert logits[0][1:] == ["-inf", "-inf"] and logits[2].count("-inf") == 0
    assert page.count('class="x"') == 3


def test_multihead_page_has_one_tab_and_panel_per_head():
    page = render_html(EXAMPLES["multihead"].traces())
    assert re.findall(r'<button type="button" data-head="(\d)"', page) == ["0", "1"]
    assert len(re.findall(r'<div class="head" data-head="\d"', page)) == 2
    assert 'data-head="1" hidden' in page
    assert "Concat" in page


def test_korean_page():
    page = render_html(EXAMPLES["cross"].traces(), lang="ko")
    assert '<html lang="ko">' in page
    for text in ("Score", "Scale &amp; Mask", "Softmax", "가중합", "나는", "학교에"):
        assert text in page, text        # the course's terms in Latin script (issue 12, item 5)
    for text in ("소프트맥스", "마스크", "쿼리", "점수"):
        assert text not in page, text


def test_trace_to_html_writes_the_file(tmp_path):
    q = torch.randn(2, 3, 4, dtype=torch.float64)
    tr = ak.explain(q, q, q, is_causal=True)
    page = tr.to_html(tmp_path / "p.html")
    assert (tmp_path / "p.html").read_text(encoding="utf-8") == page
    assert len(re.findall(r'<div class="head"', page)) == 2


# ---------------------------------------------------------------------------- a real browser


def not_blank(png: bytes) -> None:
    from PIL import Image

    img = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=float)
    assert img.shape[0] > 400 and img.shape[1] > 400
    background = np.median(img.reshape(-1, 3), axis=0)
    differs = np.abs(img - background).sum(-1) > 40
    assert differs.mean() > 0.03, f"only {differs.mean():.1%} of the page differs from background"
    assert len(np.unique(img.reshape(-1, 3)[::7], axis=0)) > 50       # colours, not a blank


@needs_chromium
def test_page_in_chromium_dump_dom(tmp_path):
    path = tmp_path / "ko.html"
    path.write_text(render_html(EXAMPLES["cross"].traces(), lang="ko"), encoding="utf-8")
    r = subprocess.run([find_chromium(), *FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
                        "--dump-dom", path.as_uri()], capture_output=True, text=True,
                       timeout=120)
    dom = r.stdout
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'data-ready="1"' in dom                      # the page's script ran to the end
    assert re.search(r'<pre id="js-errors" hidden=""></pre>', dom), "the page logged errors"
    for text in ("4. Softmax", "가중합", "W = softmax_keys(L)", "학교에"):
        assert text in dom, text


def test_page_in_chromium_with_selenium(browser, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    tr = EXAMPLES["multihead"].build()
    path = tmp_path / "page.html"
    tr.to_html(path)
    browser.get(path.as_uri())
    assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1"
    text = browser.find_element(By.TAG_NAME, "body").text
    for s in ("Score", "Scale & Mask", "Softmax", "Weighted sum", "1. MatMul", "4. Softmax"):
        assert s in text, s
    # hover a weight: the tooltip shows query, key and value
    cell = browser.find_element(
        By.CSS_SELECTOR, '.head[data-head="0"] .card[data-key="weights"] tbody tr td')
    ActionChains(browser).move_to_element(cell).perform()
    tip = browser.find_element(By.ID, "tip")
    assert tip.is_displayed()
    assert tip.text.endswith(f"I → I = {fmt(float(tr.weights[0, 0, 0]))}"), tip.text
    # head tabs switch the panels
    heads = browser.find_elements(By.CSS_SELECTOR, "section .head")
    assert [h.is_displayed() for h in heads] == [True, False]
    browser.find_element(By.CSS_SELECTOR, '.tabs button[data-head="1"]').click()
    assert [h.is_displayed() for h in heads] == [False, True]
    png = browser.get_screenshot_as_png()
    Path(tmp_path / "shot.png").write_bytes(png)
    not_blank(png)
    errors = browser.execute_script("return window.__errors")
    assert errors == []
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert severe == [], severe


def test_grouped_query_heads_show_their_shared_kv_head():
    f = torch.float64
    tr = ak.explain(torch.randn(4, 3, 8, dtype=f), torch.randn(2, 5, 8, dtype=f),
                    torch.randn(2, 5, 6, dtype=f))
    page = tr.to_html()
    assert re.findall(r"<h4>(K · kv head \d)", page) == ["K · kv head 1"] * 2 + [
        "K · kv head 2"] * 2
    assert len(re.findall(r'<div class="head" data-head="\d"', page)) == 4
    assert "kv head 2" in tr.to_text()


@needs_chromium
def test_page_reads_at_phone_width_in_korean(browser, tmp_path):
    """420 px: nothing sticks out sideways (wide parts scroll inside their own box), and
    Korean words do not break mid-word (word-break: keep-all)."""
    from selenium.webdriver.common.by import By

    path = tmp_path / "phone.html"
    path.write_text(render_html(EXAMPLES["multihead"].traces(), lang="ko"), encoding="utf-8")
    browser.set_window_size(420, 900)
    try:
        browser.get(path.as_uri())
        width = browser.execute_script("return window.innerWidth")
        assert width <= 420
        overflow = browser.execute_script(
            "return document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 1, f"the page is {overflow}px wider than the phone"
        body = browser.find_element(By.TAG_NAME, "body")
        assert body.value_of_css_property("word-break") == "keep-all"
        png = browser.get_screenshot_as_png()
        (tmp_path / "phone.png").write_bytes(png)
    finally:
        browser.set_window_size(1200, 1600)


PHONE_TABLE = """
var t=document.querySelector('table.steps'), box=t.parentNode;
return {overflow: document.documentElement.scrollWidth - window.innerWidth,
        scrolls: box.scrollWidth > box.clientWidth + 1 && getComputedStyle(box).overflowX == 'auto',
        cells: [].map.call(t.querySelectorAll('tbody td'), function(c){
          var r=c.getBoundingClientRect(); return [c.textContent, r.width, r.height];})};
"""


@needs_chromium
@pytest.mark.parametrize("lang", ["en", "ko"])
def test_step_table_reads_at_phone_width(browser, tmp_path, lang):
    """420 px: the page does not scroll sideways, and the five-step table is not squeezed
    into slivers (it was: 38-px cells, "모 / 양" and "(4, / 3)" on two lines each) — its
    cells are at least 120 px wide, or the table scrolls inside its own box."""
    path = tmp_path / f"table-{lang}.html"
    path.write_text(render_html(EXAMPLES["cross"].traces(), lang=lang), encoding="utf-8")
    browser.set_window_size(420, 900)
    try:
        browser.get(path.as_uri())
        assert browser.execute_script("return window.innerWidth") <= 420
        got = browser.execute_script(PHONE_TABLE)
    finally:
        browser.set_window_size(1200, 1600)
    assert got["overflow"] <= 1, f"the page is {got['overflow']}px wider than the phone"
    narrow = [(text, round(w)) for text, w, _ in got["cells"] if w < 120]
    assert got["scrolls"] or not narrow, f"step-table cells squeezed at 420 px: {narrow}"
    # a shape such as (4, 3) or a step name stays on one line
    one_line = [c for c in got["cells"] if c[0].startswith(("(", "1.", "4."))]
    assert one_line and all(h < 36 for _, _, h in one_line), one_line


@pytest.mark.parametrize("lang", ["en", "ko"])
def test_flow_and_table_use_the_same_step_names(lang):
    """Every step the table names is named the same way in the flow diagram (its numbered
    sub-labels), and the table's "in the flow" column holds exactly the diagram's box names."""
    tr = EXAMPLES["worked"].build()
    page = render_html([tr], lang=lang)
    flow = page[page.index('<svg class="flow"'):page.index("</svg>")]
    table = page[page.index('<table class="steps">'):]
    table = table[:table.index("</table>")]
    boxes = re.findall(r'<text class="name"[^>]*>([^<]+)</text><text class="steps"', flow)
    subs = " · ".join(re.findall(r'<text class="steps"[^>]*>([^<]+)</text>', flow))
    steps = re.findall(r'<td class="n"[^>]*>([^<]+)</td>', table)
    stages = re.findall(r'<td class="st"[^>]*>([^<]+)</td>', table)
    assert len(steps) == len(tr.steps) == 5
    assert subs.split(" · ") == steps, (lang, subs, steps)
    assert list(dict.fromkeys(stages)) == boxes, (lang, stages, boxes)
    expected = (["Score", "Scale &amp; Mask", "Softmax", "Weighted sum"] if lang == "en" else
                ["Score", "Scale &amp; Mask", "Softmax", "가중합"])
    assert boxes == expected
