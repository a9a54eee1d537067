"""The page's playground: the page recomputes every step itself, and shows Python's digits.

A real headless Chromium (the run's one driver, helpers.webpage.shared_driver) moves the slider
with the keyboard, edits a Q cell, switches the mask to causal and blocks cells by click and by
Enter; after each change every number on the page (S, X, L, W with its row sums, O) is compared with
``ak.explain`` on the same inputs, printed by the same rules (``cell_formatter``, ``fmt``).
"""

from __future__ import annotations

import json
import re

import numpy as np
import torch

import attnkit as ak
from attnkit.explain.examples import EXAMPLES
from attnkit.explain.html import render_html
from attnkit.explain.live import MAX_SIDE, playable
from helpers.playground import READ, check_page
from helpers.webpage import needs_chromium


@needs_chromium
def test_playground_recomputes_every_step_like_python(browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, generator=g, dtype=torch.float64)
    k = torch.randn(4, 4, generator=g, dtype=torch.float64)
    v = torch.randn(4, 2, generator=g, dtype=torch.float64)
    tr = ak.explain(q, k, v).labelled(["I", "like", "cats"], ["I", "like", "cats", "."])
    path = tmp_path / "play.html"
    tr.to_html(path)
    browser.get(path.as_uri())
    assert browser.execute_script("return window.__errors") == []
    sel = "section.play"
    q, k, v = q.numpy(), k.numpy(), v.numpy()
    allowed = np.ones((3, 4), dtype=bool)
    check_page(browser.execute_script(READ, sel), q, k, v, allowed, tr.scale)

    # 1. the slider, by keyboard: five steps right = ×1.5, then End = ×10 (the course's lesson)
    slider = browser.find_element(By.CSS_SELECTOR, f"{sel} .pl-factor")
    slider.send_keys(*[Keys.ARROW_RIGHT] * 5)
    page = browser.execute_script(READ, sel)
    assert page["state"]["factor"] == 1.5
    check_page(page, q, k, v, allowed, tr.scale * 1.5)
    slider.send_keys(Keys.END)
    page = browser.execute_script(READ, sel)
    assert page["state"]["factor"] == 10
    check_page(page, q, k, v, allowed, tr.scale * 10)
    assert max(float(x) for x in page["weights"][0][:4]) > 0.9          # ×10: sharp

    # 2. edit a cell of Q
    cell = browser.find_element(By.CSS_SELECTOR,
                                f'{sel} input.pl-in[data-m="q"][data-i="1"][data-j="2"]')
    cell.clear()
    cell.send_keys("2.5")
    q = q.copy()
    q[1, 2] = 2.5
    check_page(browser.execute_script(READ, sel), q, k, v, allowed, tr.scale * 10)
    cell.send_keys("x")                                   # not a number: marked, not used
    assert "bad" in cell.get_attribute("class")
    check_page(browser.execute_script(READ, sel), q, k, v, allowed, tr.scale * 10)

    # 3. the mask: causal from the select, then block cells by click and by keyboard
    Select(browser.find_element(By.CSS_SELECTOR, f"{sel} .pl-mode")).select_by_value("causal")
    allowed = np.tril(np.ones((3, 4), dtype=bool))
    check_page(browser.execute_script(READ, sel), q, k, v, allowed, tr.scale * 10)
    browser.find_element(By.CSS_SELECTOR, f'{sel} button.pl-cell[data-i="2"][data-j="1"]').click()
    b = browser.find_element(By.CSS_SELECTOR, f'{sel} button.pl-cell[data-i="0"][data-j="0"]')
    b.send_keys(Keys.ENTER)                               # query 1 now sees no key at all
    assert b.get_attribute("aria-pressed") == "true"
    allowed[2, 1] = allowed[0, 0] = False
    page = browser.execute_script(READ, sel)
    check_page(page, q, k, v, allowed, tr.scale * 10)
    assert page["output"][0] == ["0", "0"] and page["weights"][0][-1] == "0"

    # 4. padding: only the first two keys count (with the blocked cells still blocked)
    Select(browser.find_element(By.CSS_SELECTOR, f"{sel} .pl-mode")).select_by_value("padding")
    pad = browser.find_element(By.CSS_SELECTOR, f"{sel} .pl-pad")
    pad.send_keys(Keys.ARROW_DOWN, Keys.ARROW_DOWN)
    allowed = np.zeros((3, 4), dtype=bool)
    allowed[:, :2] = True
    allowed[2, 1] = allowed[0, 0] = False
    page = browser.execute_script(READ, sel)
    assert page["state"]["pad"] == 2
    check_page(page, q, k, v, allowed, tr.scale * 10)

    # 5. reset: the trace's own inputs and numbers again
    browser.find_element(By.CSS_SELECTOR, f"{sel} .pl-reset").click()
    page = browser.execute_script(READ, sel)
    check_page(page, tr.q, tr.k, tr.v, np.ones((3, 4), dtype=bool), tr.scale)
    assert [float(x) for x in page["q"]] == tr.q.ravel().tolist()     # exact, via repr
    assert browser.execute_script("return window.__errors") == []
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert severe == [], severe


@needs_chromium
def test_playground_in_korean_with_a_causal_example_and_softcap(browser, tmp_path):
    from selenium.webdriver.common.by import By

    tr = EXAMPLES["causal"].build()
    capped = ak.explain(tr.q, tr.k, tr.v, is_causal=True, softcap=0.5)
    path = tmp_path / "ko.html"
    path.write_text(render_html([tr, capped], lang="ko"), encoding="utf-8")
    browser.get(path.as_uri())
    text = browser.find_element(By.TAG_NAME, "body").text
    assert "직접 해 보기" in text and "Mask M" in text
    n = tr.q.shape[0]
    causal = np.tril(np.ones((n, tr.k.shape[0]), dtype=bool))
    for sel, t, cap in (("#play0", tr, None), ("#play1", capped, 0.5)):
        page = browser.execute_script(READ, sel)
        assert page["state"]["mode"] == "causal"
        check_page(page, t.q, t.k, t.v, causal, t.scale, cap)
    assert browser.execute_script("return window.__errors") == []


def test_page_html_holds_the_playground_data_exactly():
    tr = EXAMPLES["masked"].build()
    page = tr.to_html()
    blob = re.search(r'<script type="application/json" class="pl-data">(.*?)</script>', page)
    data = json.loads(blob.group(1))
    assert np.array_equal(np.array(data["q"]), tr.q) and data["base"] == tr.scale
    assert np.array_equal(~np.array(data["blocked"]), tr.allowed)
    # every input cell carries the full float (repr), so the page computes from the same numbers
    vals = re.findall(r'data-m="k" data-i="\d+" data-j="\d+" inputmode="decimal" value="([^"]+)"',
                      page)
    assert [float(x) for x in vals] == tr.k.ravel().tolist()


def test_no_playground_for_large_or_score_mod_traces():
    big = torch.randn(MAX_SIDE + 1, 4, dtype=torch.float64)
    tr = ak.explain(big, big, big)
    assert not playable(tr) and 'class="play"' not in tr.to_html()
    small = torch.randn(3, 4, dtype=torch.float64)
    mod = ak.explain(small, small, small, score_mod=lambda s, b, h, i, j: s + 0 * i)
    assert not playable(mod)
    assert "No playground" in mod.to_html() and "직접 해 보기가 없습니다" in mod.to_html(lang="ko")
