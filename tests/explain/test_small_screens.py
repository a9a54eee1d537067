"""A phone in Chromium (issue 22, item 6): the explain page's flow diagram fits a 360-px
screen (it kept a 640-px minimum width there: clipped, with tiny text), a tap on a heatmap
cell shows its value as hover does (the page said "마우스를 올리면", which a touch screen
cannot do), and the docs site's Korean pages keep Korean words whole (``라이/브러리`` was
broken mid-word): ``word-break: keep-all``.

Set ``ATTNKIT_SCREENSHOTS`` to a folder to keep the screenshots.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from attnkit.explain.common import fmt
from attnkit.explain.examples import EXAMPLES
from attnkit.explain.html import render_html
from attnkit.explain.strings import STRINGS
from helpers.webpage import needs_chromium

pytestmark = needs_chromium

ROOT = Path(__file__).resolve().parents[2]
PHONE = 360


def shoot(browser, tmp_path: Path, name: str) -> None:  # noqa: ANN001
    browser.save_screenshot(str(tmp_path / name))
    shots = os.environ.get("ATTNKIT_SCREENSHOTS")
    if shots:
        browser.save_screenshot(str(Path(shots) / name))


# The flow diagrams of the first section that are shown (display is not none), each with its
# box, the smallest height of its text lines, and the window's width.
FLOW = """
const vw = document.documentElement.clientWidth;
const wrap = document.querySelector('section.trace .flow-wrap');
const shown = [...wrap.querySelectorAll('svg.flow')].filter(
  s => getComputedStyle(s).display != 'none');
return {vw: vw, page: document.documentElement.scrollWidth,
        wrap: {scroll: wrap.scrollWidth, client: wrap.clientWidth},
        svgs: shown.map(s => {
          const r = s.getBoundingClientRect();
          const hs = [...s.querySelectorAll('text')].map(t => t.getBoundingClientRect().height);
          return {cls: s.getAttribute('class'), left: r.left, right: r.right, top: r.top,
                  bottom: r.bottom, text: Math.min(...hs),
                  words: [...s.querySelectorAll('text')].map(t => t.textContent)};
        })};
"""


@pytest.mark.parametrize("lang", ["en", "ko"])
def test_flow_diagram_fits_a_phone_and_stays_readable(browser, tmp_path, lang):
    path = tmp_path / f"flow-{lang}.html"
    path.write_text(render_html(EXAMPLES["multihead"].traces(), lang=lang), encoding="utf-8")
    browser.set_window_size(PHONE, 900)
    try:
        browser.get(path.as_uri())
        got = browser.execute_script(FLOW)
        browser.execute_script(
            "document.querySelector('section.trace .flow-wrap').scrollIntoView()")
        shoot(browser, tmp_path, f"flow_{lang}_{PHONE}.png")
    finally:
        browser.set_window_size(1200, 1600)
    vw = got["vw"]
    assert vw <= PHONE
    assert len(got["svgs"]) == 1, got["svgs"]                 # one diagram, not two
    svg = got["svgs"][0]
    assert svg["left"] >= 0 and svg["right"] <= vw + 0.5, (vw, svg)
    assert got["wrap"]["scroll"] <= got["wrap"]["client"] + 1, got["wrap"]   # nothing hidden
    assert got["page"] <= vw + 1, f"the page scrolls sideways ({got['page']} > {vw})"
    assert svg["text"] >= 11, f"the flow's text is {svg['text']:.1f} px tall at {PHONE} px"
    words = " ".join(svg["words"])
    for word in ("Q", "K", "V", "O", "Softmax", STRINGS[lang]["page_stage_sum"],
                 STRINGS[lang]["page_per_head"].format(h=2)):
        assert word in words, word


def test_wide_screen_shows_the_wide_flow_diagram(browser, tmp_path):
    path = tmp_path / "flow-wide.html"
    path.write_text(render_html(EXAMPLES["multihead"].traces()), encoding="utf-8")
    browser.get(path.as_uri())                                 # the default 1200 px window
    got = browser.execute_script(FLOW)
    assert [s["cls"] for s in got["svgs"]] == ["flow"]
    assert got["svgs"][0]["right"] <= got["vw"] + 0.5


TIP = """
const tip = document.getElementById('tip'), r = tip.getBoundingClientRect();
return {shown: getComputedStyle(tip).display != 'none', text: tip.textContent,
        left: r.left, right: r.right, top: r.top, bottom: r.bottom,
        vw: document.documentElement.clientWidth, vh: window.innerHeight};
"""


@pytest.mark.parametrize("lang", ["en", "ko"])
def test_a_tap_on_a_cell_shows_its_value_as_hover_does(browser, tmp_path, lang):
    """A tap is a click with no hover before it (``el.click()`` sends only the click): it
    shows the cell's value in the same tip, inside the phone's window; a tap on the same
    cell, or anywhere else, hides it again."""
    from selenium.webdriver.common.by import By

    tr = EXAMPLES["multihead"].build()
    path = tmp_path / f"tap-{lang}.html"
    path.write_text(render_html([tr], lang=lang), encoding="utf-8")
    browser.set_window_size(PHONE, 800)
    try:
        browser.get(path.as_uri())
        w = '.head[data-head="0"] .card[data-key="weights"] tbody tr'
        cell = browser.find_element(By.CSS_SELECTOR, f"{w} td")
        browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", cell)
        assert not browser.execute_script(TIP)["shown"]
        browser.execute_script("arguments[0].click()", cell)
        got = browser.execute_script(TIP)
        shoot(browser, tmp_path, f"tap_{lang}_{PHONE}.png")
        assert got["shown"], "a tap on a weight cell showed nothing"
        assert got["text"].endswith(f"I → I = {fmt(float(tr.weights[0, 0, 0]))}"), got["text"]
        assert got["text"].startswith("4. Softmax"), got["text"]
        assert got["left"] >= 0 and got["right"] <= got["vw"] + 0.5, got
        assert got["top"] >= 0 and got["bottom"] <= got["vh"] + 0.5, got
        assert "on" in cell.get_attribute("class").split()         # the tapped cell is marked
        # a tap on another cell moves the tip there
        other = browser.find_element(By.CSS_SELECTOR, f"{w}:nth-child(2) td:nth-of-type(2)")
        browser.execute_script("arguments[0].click()", other)
        got = browser.execute_script(TIP)
        assert got["shown"] and " → " in got["text"], got["text"]
        assert got["text"].endswith(f" = {fmt(float(tr.weights[0, 1, 1]))}"), got["text"]
        assert "on" not in (cell.get_attribute("class") or "")
        browser.execute_script("arguments[0].click()", other)      # the same cell: hidden
        assert not browser.execute_script(TIP)["shown"]
        browser.execute_script("arguments[0].click()", cell)
        browser.execute_script("document.querySelector('header h1').click()")   # elsewhere
        assert not browser.execute_script(TIP)["shown"]
        assert browser.execute_script("return window.__errors") == []
    finally:
        browser.set_window_size(1200, 1600)


# Two animation frames: a scroll event queued by a scroll has been delivered after them.
FRAMES = """const done = arguments[arguments.length - 1];
requestAnimationFrame(() => requestAnimationFrame(() => done(null)));"""


def test_a_tapped_value_survives_a_scroll_on_its_way_and_follows_its_cell(browser, tmp_path):
    """A scroll still on its way when the tap comes (CI's Chromium delivered the event of
    ``scrollIntoView`` after the tap, which hid the value at once) leaves the tip shown, under
    its cell; a scroll that takes the cell out of the window hides it."""
    from selenium.webdriver.common.by import By

    path = tmp_path / "tap-scroll.html"
    path.write_text(render_html([EXAMPLES["multihead"].build()]), encoding="utf-8")
    browser.set_window_size(PHONE, 800)
    try:
        browser.get(path.as_uri())
        w = '.head[data-head="0"] .card[data-key="weights"] tbody tr'
        cell = browser.find_element(By.CSS_SELECTOR, f"{w} td")
        browser.execute_script("arguments[0].scrollIntoView({block: 'center'});"
                               "window.scrollBy(0, -60); arguments[0].click()", cell)
        browser.execute_async_script(FRAMES)
        got = browser.execute_script(TIP)
        assert got["shown"], "a scroll delivered after the tap hid the value"
        cell_box = browser.execute_script(
            "const r = arguments[0].getBoundingClientRect(); return [r.left, r.bottom];", cell)
        assert abs(got["top"] - (cell_box[1] + 6)) < 1 or got["bottom"] <= cell_box[1], (
            got, cell_box)                                   # under its cell (or above it)
        browser.execute_script("window.scrollBy(0, 4 * window.innerHeight)")
        browser.execute_async_script(FRAMES)
        assert not browser.execute_script(TIP)["shown"], "the cell left but its value stayed"
        assert browser.execute_script("return window.__errors") == []
    finally:
        browser.set_window_size(1200, 1600)


@pytest.mark.parametrize("lang", ["en", "ko"])
def test_the_page_says_tap_not_only_hover(lang):
    page = render_html([EXAMPLES["worked"].build()], lang=lang)
    legend = STRINGS[lang]["page_legend"]
    assert legend in page
    if lang == "ko":
        assert "누르거나 마우스를 올리면" in legend
        assert all("누르거나" in v for v in STRINGS["ko"].values() if "마우스" in v)
    else:
        assert "Tap or hover" in legend
        assert all(re.search("tap or hover", v, re.I) for v in STRINGS["en"].values()
                   if re.search(r"\bhover\b", v, re.I))


# ---------------------------------------------------------------------------- the docs site


def test_korean_docs_pages_link_the_keep_all_rule(docs_site):
    css = (docs_site / "stylesheets" / "ko.css").read_text("utf-8")
    rule = re.search(r":lang\(ko\)\s*\{([^}]*)\}", css)
    assert rule and re.search(r"word-break:\s*keep-all", rule.group(1)), css
    assert re.search(r"overflow-wrap:\s*(anywhere|break-word)", rule.group(1)), css
    ko = (docs_site / "getting-started-ko" / "index.html").read_text("utf-8")
    assert re.search(r'<link rel="stylesheet" href="\.\./stylesheets/ko\.css">', ko)
    assert re.search(r'<div lang="ko">\s*<h1', ko)            # the page's content is Korean


def test_korean_docs_page_keeps_words_whole_in_chromium(browser, docs_site, tmp_path):
    style = """return [...document.querySelectorAll('article p')].slice(0, 3).map(
      p => [getComputedStyle(p).wordBreak, getComputedStyle(p).overflowWrap]);"""
    browser.set_window_size(PHONE, 900)
    try:
        browser.get((docs_site / "getting-started-ko" / "index.html").as_uri())
        ko = browser.execute_script(style)
        shoot(browser, tmp_path, f"docs_ko_{PHONE}.png")
        browser.get((docs_site / "getting-started" / "index.html").as_uri())
        en = browser.execute_script(style)
    finally:
        browser.set_window_size(1200, 1600)
    assert ko and all(wb == "keep-all" and ow in ("anywhere", "break-word") for wb, ow in ko), ko
    assert en and all(wb == "normal" for wb, _ in en), en       # English pages: unchanged
