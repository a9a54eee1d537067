"""The playground for wide rows (issue 22, defect 2): the √d_k example (d_k = 64) had no
playground ("at most 16 … features"). Now a row wider than ``INLINE`` features is one canvas
strip (a colour per feature), a tap or the keyboard picks a feature and one field edits it,
and the slider and mask modes recompute every step as before — in Chromium at 360 and
1280 px, with every number compared with ``ak.explain`` and every row of weights summing to
1.000. The page's size is checked as a count of elements (it must not grow with d), never
as a time.

Set ``ATTNKIT_SCREENSHOTS`` to a folder to keep the screenshots.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import attnkit as ak
from attnkit.explain.examples import EXAMPLES
from attnkit.explain.html import render_html
from attnkit.explain.live import INLINE, MAX_FEATURES, MAX_SIDE, playable, playground
from helpers.playground import READ, check_page
from helpers.webpage import needs_chromium

# Resolves after two animation frames: the page has handled the events sent before it and
# drawn what they changed (a selenium call returning does not mean the page has caught up).
FRAMES = """
const done = arguments[arguments.length - 1];
requestAnimationFrame(() => requestAnimationFrame(() => done(true)));
"""

WIDE = """
const sec = document.querySelector(arguments[0]);
const rows = [...sec.querySelectorAll('[data-pl-vec="output"] .pl-vrow')];
const cvs = [...sec.querySelectorAll('canvas.pl-vec')];
return {output: rows.map(r => r.getAttribute('data-v').split(' ')),
        at: (sec.querySelector('.pl-edit-at') || {}).textContent,
        edit: (sec.querySelector('.pl-edit-in') || {}).value,
        focused: document.activeElement.className,
        canvases: cvs.length,
        drawn: cvs.every(c => { const d = c.getContext('2d').getImageData(0, 0, c.width, 1).data;
                                 return d.some((x, i) => i % 4 == 3 && x == 255); }),
        elements: sec.getElementsByTagName('*').length,
        page: document.getElementsByTagName('*').length,
        vw: document.documentElement.clientWidth,
        scroll: document.documentElement.scrollWidth,
        ready: sec.getAttribute('data-ready')};
"""


def settle(browser) -> None:  # noqa: ANN001
    browser.execute_async_script(FRAMES)


def shoot(browser, tmp_path: Path, name: str) -> None:  # noqa: ANN001
    browser.save_screenshot(str(tmp_path / name))
    shots = os.environ.get("ATTNKIT_SCREENSHOTS")
    if shots:
        browser.save_screenshot(str(Path(shots) / name))


def page_of(browser, sel: str) -> dict:  # noqa: ANN001
    settle(browser)
    got = browser.execute_script(READ, sel)
    wide = browser.execute_script(WIDE, sel)
    if not wide["output"]:                 # O is a table (READ has it), not strips
        del wide["output"]
    got.update(wide)
    return got


def test_the_sqrt_dk_example_has_a_playground_and_wide_rows_stay_small():
    raw, scaled = EXAMPLES["scaling"].traces()
    assert raw.q.shape[-1] == 64 and playable(raw) and playable(scaled)
    page = render_html([raw, scaled])
    assert page.count('<section class="play"') == 2 and "No playground" not in page
    assert 'canvas class="pl-vec"' in page and 'class="pl-in"' in page    # K strips, V cells

    def play(d: int) -> str:
        g = torch.Generator().manual_seed(d)
        x = torch.randn(MAX_SIDE, d, generator=g, dtype=torch.float64)
        return playground(ak.explain(x, x, x), "en", 0)

    # the playground's markup does not grow with d: 17 and 512 features, the same tags
    small, wide = play(INLINE + 1), play(MAX_FEATURES)
    tags = re.compile(r"<[a-z]")
    assert len(tags.findall(small)) == len(tags.findall(wide)) < 2500
    assert small.count("<input") == wide.count("<input") == 3     # slider, pad, the edit field
    tr = ak.explain(torch.randn(3, MAX_FEATURES + 1, dtype=torch.float64),
                    torch.randn(3, MAX_FEATURES + 1, dtype=torch.float64),
                    torch.randn(3, 2, dtype=torch.float64))
    assert not playable(tr) and f"at most {MAX_FEATURES} features" in tr.to_html()


@needs_chromium
@pytest.mark.parametrize("width", [360, 1280])
def test_sqrt_dk_playground_in_chromium(browser, tmp_path, width):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    raw, scaled = EXAMPLES["scaling"].traces()
    path = tmp_path / f"scaling-{width}.html"
    path.write_text(render_html([raw, scaled]), encoding="utf-8")
    browser.set_window_size(width, 1000)
    sel = "#play1"                                      # the scaled half: scale = 1/8
    try:
        browser.get(path.as_uri())
        q, k, v = scaled.q.copy(), scaled.k.copy(), scaled.v
        allowed = np.ones((1, 3), dtype=bool)
        page = page_of(browser, sel)
        assert browser.execute_script("return window.__errors") == []
        assert page["ready"] == "1" and page["canvases"] == 4 and page["drawn"]   # q1, k1-k3
        assert page["scroll"] <= page["vw"] + 1, "the page scrolls sideways"
        check_page(page, q, k, v, allowed, scaled.scale)
        assert page["weights"][0] == ["0.665", "0.245", "0.090", "1.000"]
        assert page["at"] == "Q row q1, feature d1" and page["edit"] == "1"

        # the course's point: ×8 undoes ÷√64 — the logits are the raw scores, softmax saturates
        slider = browser.find_element(By.CSS_SELECTOR, f"{sel} .pl-factor")
        slider.send_keys(Keys.END, *[Keys.ARROW_LEFT] * 20)                  # ×10 − 2.0
        page = page_of(browser, sel)
        assert page["state"]["factor"] == 8
        check_page(page, q, k, v, allowed, 1.0)
        assert page["weights"][0][0] == "0.9997" and page["weights"][0][-1] == "1.000"

        # pick feature d1 of k3 with a tap on the strip's left end, then edit it
        strip = browser.find_element(By.CSS_SELECTOR,
                                     f'{sel} canvas.pl-vec[data-m="k"][data-i="2"]')
        browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", strip)
        settle(browser)
        w = strip.size["width"]
        ActionChains(browser).move_to_element_with_offset(strip, -w // 2 + 1, 0).click().perform()
        page = page_of(browser, sel)
        assert page["at"] == "K row k3, feature d1" and page["edit"] == "1", page["at"]
        edit = browser.find_element(By.CSS_SELECTOR, f"{sel} .pl-edit-in")
        edit.clear()
        edit.send_keys("9")
        k[2, 0] = 9.0
        page = page_of(browser, sel)
        check_page(page, q, k, v, allowed, 1.0)                   # k3 now scores 9 > 8
        # the keyboard: on the strip, → three times picks d4, Enter goes to the field
        strip.send_keys(Keys.ARROW_RIGHT, Keys.ARROW_RIGHT, Keys.ARROW_RIGHT, Keys.ENTER)
        page = page_of(browser, sel)
        assert page["at"] == "K row k3, feature d4" and page["edit"] == "-1"
        assert "pl-edit-in" in page["focused"]
        browser.switch_to.active_element.send_keys(Keys.BACKSPACE * 4, "x")   # not a number
        page = page_of(browser, sel)
        assert "bad" in edit.get_attribute("class")
        check_page(page, q, k, v, allowed, 1.0)                   # marked, not used

        # the mask modes still work with wide rows: causal (query 1 sees key 1), padding
        Select(browser.find_element(By.CSS_SELECTOR, f"{sel} .pl-mode")).select_by_value("causal")
        page = page_of(browser, sel)
        check_page(page, q, k, v, np.array([[True, False, False]]), 1.0)
        Select(browser.find_element(By.CSS_SELECTOR, f"{sel} .pl-mode")).select_by_value(
            "padding")
        browser.find_element(By.CSS_SELECTOR, f"{sel} .pl-pad").send_keys(Keys.ARROW_DOWN)
        page = page_of(browser, sel)
        assert page["state"]["pad"] == 2
        check_page(page, q, k, v, np.array([[True, True, False]]), 1.0)
        shoot(browser, tmp_path, f"scaling_play_{width}.png")

        browser.find_element(By.CSS_SELECTOR, f"{sel} .pl-reset").click()
        page = page_of(browser, sel)
        check_page(page, scaled.q, scaled.k, scaled.v, np.ones((1, 3), dtype=bool), scaled.scale)
        assert page["at"] == "Q row q1, feature d1"
        assert browser.execute_script("return window.__errors") == []
    finally:
        browser.set_window_size(1200, 1600)


@needs_chromium
@pytest.mark.parametrize("width", [360, 1280])
def test_a_few_hundred_features_keep_the_page_small(browser, tmp_path, width):
    """16 queries and keys of 300 features (d_v 300 too: O is strips as well): the playground
    is the same few hundred elements as with 17 features, every row of weights sums to
    1.000, and O's printed values are Python's."""
    g = torch.Generator().manual_seed(7)
    n, d = MAX_SIDE, 300
    q, k, v = (torch.randn(n, d, generator=g, dtype=torch.float64) for _ in range(3))
    tr = ak.explain(q, k, v, is_causal=True)
    few = ak.explain(q[:, :INLINE + 1], k[:, :INLINE + 1], v[:, :INLINE + 1], is_causal=True)
    path = tmp_path / f"wide-{width}.html"
    path.write_text(render_html([tr, few], lang="ko"), encoding="utf-8")
    browser.set_window_size(width, 1000)
    try:
        browser.get(path.as_uri())
        page = page_of(browser, "#play0")
        other = page_of(browser, "#play1")
        assert browser.execute_script("return window.__errors") == []
        assert page["elements"] == other["elements"] < 2500, (page["elements"],
                                                               other["elements"])
        assert page["canvases"] == 4 * n and page["drawn"]          # Q, K, V and O: a strip a row
        assert page["scroll"] <= page["vw"] + 1
        allowed = np.tril(np.ones((n, n), dtype=bool))
        q, k, v = tr.q, tr.k, tr.v
        assert page["state"]["mode"] == "causal"
        sums = [row[-1] for row in page["weights"]]
        assert sums == ["1.000"] * n
        check_page(page, q, k, v, allowed, tr.scale)
        assert re.fullmatch(r"Q의 q1 행, 특징 d1", page["at"]), page["at"]
        from selenium.webdriver.common.by import By
        from selenium.webdriver.common.keys import Keys

        fac = browser.find_element(By.CSS_SELECTOR, "#play0 .pl-factor")
        fac.send_keys(*[Keys.ARROW_RIGHT] * 10)                               # ×2.0
        page = page_of(browser, "#play0")
        assert page["state"]["factor"] == 2
        assert [row[-1] for row in page["weights"]] == ["1.000"] * n
        check_page(page, q, k, v, allowed, 2 * tr.scale)          # every step, O included
        browser.execute_script("document.querySelector('#play0').scrollIntoView()")
        settle(browser)
        shoot(browser, tmp_path, f"wide_play_{width}.png")
    finally:
        browser.set_window_size(1200, 1600)
