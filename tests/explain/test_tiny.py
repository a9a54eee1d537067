"""tiny-ko (issue 22, "Beyond the two best-known tools", items 1 and 2): a tiny Korean
character-level causal Transformer built from attnkit's layers, trained here by
``attnkit train-tiny`` on the Korean text that ships with the package, and its real heads
and next-token probabilities (with a temperature slider) on the explain page.

The module trains the model once, through the real command, into a fresh cache folder
(``trained``), and every other test reads that model; the determinism test trains two short
runs of its own. The browser test moves the slider with the keyboard, waits two animation
frames and reads what the page shows — it never assumes an event arrived.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from attnkit.cli import main
from attnkit.explain import explain_model, tiny
from attnkit.explain.model import ModelError, next_probabilities
from attnkit.explain.modelview import slider_temperature
from helpers.korean import AWKWARD, TRANSLITERATED, WRONG_PARTICLE
from helpers.webpage import needs_chromium

CACHE_ROOT = tiny.cache_root                 # before the module's fixture replaces it
FRAMES = ("var done=arguments[arguments.length-1];"
          "requestAnimationFrame(function(){requestAnimationFrame(function(){done(1);});});")
READ = """
const box = document.querySelector('.nextv');
const rows = [...box.querySelectorAll('tr[data-j]')].map(r => ({
  j: +r.dataset.j, p: parseFloat(r.querySelector('td.nx-p').dataset.p),
  shown: r.querySelector('td.nx-p').textContent}));
const rest = parseFloat(box.querySelector('tr.nx-rest td.nx-p').dataset.p);
return {rows: rows, rest: rest, state: JSON.parse(box.dataset.state),
        sum: parseFloat(box.querySelector('.nx-sum').dataset.v),
        label: box.querySelector('.nx-tv').textContent,
        errors: window.__errors || []};
"""


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Any:
    """A fresh cache folder for this module (the real one is left alone)."""
    root = tmp_path_factory.mktemp("tiny-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiny, "cache_root", lambda: root)
        yield root


@pytest.fixture(scope="module")
def trained(cache) -> dict[str, Any]:
    """``attnkit train-tiny``, the real command (the default configuration), once."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["train-tiny"])
    return {"rc": rc, "err": err.getvalue(), "path": tiny.cache_path()}


@pytest.fixture(scope="module")
def mt(trained) -> Any:
    return explain_model("tiny-ko")             # the default text, its last character


def test_train_tiny_trains_with_a_progress_bar_and_caches(trained):
    assert trained["rc"] == 0, trained["err"]
    err = trained["err"]
    steps = tiny.TinyConfig().steps
    assert f"{steps}/{steps}" in err and "[" + "#" * 24 + "]" in err      # the bar, finished
    assert "attnkit: tiny-ko trained in" in err and str(trained["path"]) in err
    assert trained["path"].is_file()
    import contextlib
    import io

    again = io.StringIO()
    with contextlib.redirect_stderr(again):
        assert main(["train-tiny", "--lang", "ko"]) == 0                   # cached: no work
    assert "이미 학습되어" in again.getvalue() and "[#" not in again.getvalue()


def test_the_cache_is_attnkits_own(monkeypatch, tmp_path):
    """The native kernel's cache folder: $ATTNKIT_CACHE_DIR, else $XDG_CACHE_HOME/attnkit."""
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path / "a"))
    assert CACHE_ROOT() == tmp_path / "a" / "tiny-ko"
    monkeypatch.delenv("ATTNKIT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert CACHE_ROOT() == tmp_path / "x" / "attnkit" / "tiny-ko"


def test_the_loss_falls(trained):
    _, vocab, losses = tiny.cached()
    assert len(losses) == tiny.TinyConfig().steps
    first, last = losses[0], float(np.mean(losses[-20:]))
    assert first > math.log(len(vocab)) - 1          # starts near a uniform guess
    assert last < 0.1 * first and last < 0.5, (first, last)


def test_training_is_deterministic():
    cfg = tiny.with_steps(tiny.TinyConfig(), 8)
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    m1, _, l1 = tiny.train(cfg)
    m2, _, l2 = tiny.train(cfg)
    assert torch.equal(torch.rand(3), before)             # the caller's RNG untouched
    assert l1 == l2
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    m3, _, l3 = tiny.train(tiny.TinyConfig(steps=8, seed=1))       # another seed differs
    assert l3 != l1


def test_a_local_head_emerges(trained):
    """On a sentence of the text, some head gives the three characters just before each
    query most of its weight (> 0.6 on average; a head spread evenly gives 0.16 here, and
    no head of the untrained model gives more than 0.3), and the page walks through it."""
    text = "Query와 Key의 내적이 Score가 됩니다. 두 벡터가 같은 방향을 가리키면 Score가 크고"
    m = explain_model("tiny-ko", text)
    score = tiny.local_score(m.weights)                                # (L, H)
    assert score.max() > 0.6, np.round(score, 3)
    li, h = np.unravel_index(int(np.argmax(score)), score.shape)
    assert m.focus[:2] == (li + 1, h + 1)
    found = tiny.local_head(m.weights)
    assert found is not None and found[:2] == m.focus[:2] and found[3] < 0.2
    assert f"layer {li + 1}, head {h + 1}" in m.to_text("en")
    untrained = tiny.TinyLM(len(m.vocab), tiny.TinyConfig())                # the same, unlearnt
    rec: list = []
    with torch.no_grad():
        untrained(torch.tensor([tiny.Vocab.of(tiny.corpus()).encode(text)]), rec)
    from attnkit.explain.model import traces_of

    w0 = np.stack([tr.weights for tr in traces_of(rec)])
    assert tiny.local_score(w0).max() < 0.3


def test_text_output_shows_the_heads_and_the_next_token(trained, capsys):
    assert main(["explain", "--model", "tiny-ko", "--lang", "ko"]) == 0
    out = capsys.readouterr().out
    mt = explain_model("tiny-ko")
    assert mt.tokens == [tiny.Vocab.label(c) for c in tiny.DEFAULT_TEXT]
    assert mt.focus[2] == len(mt.tokens)                                # the last character
    assert "다음에 올 토큰" in out and "레이어" in out and "Softmax" in out
    top = mt.next_token(mt.focus[2], 1.0, 5)
    assert top[0][0] == "눕"                       # "… √d_k로 나" → "눕니다", learnt by heart
    for name, p in top:                             # the printed top-5 is the model's own
        assert re.search(rf"'{re.escape(name)}'\s+{p:.3f}", out), (name, p)
    p = next_probabilities(mt.logits[-1])
    assert abs(p.sum() - 1) < 1e-12 and p[mt.vocab.index("눕")] == top[0][1]
    for word, bad in (("head", "헤드"), ("logit", "로짓")):
        assert bad not in out, word


def test_softmax_with_temperature():
    z = np.array([2.0, 1.0, -1.0, 2.0])
    assert next_probabilities(z, 0).tolist() == [1, 0, 0, 0]            # the first of a tie
    p1 = next_probabilities(z, 1)
    assert np.allclose(p1, np.exp(z) / np.exp(z).sum(), atol=0, rtol=1e-15)
    hot = next_probabilities(z, 1e6)
    assert np.allclose(hot, 0.25, atol=1e-5)                             # T large: uniform
    cold = next_probabilities(z * 1000, 0.5)                             # no overflow
    assert np.isfinite(cold).all() and abs(cold.sum() - 1) < 1e-12
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ModelError, match="temperature"):
            next_probabilities(z, bad)
    assert slider_temperature(0) == 0 and slider_temperature(50) == 1.0


def test_characters_the_model_never_saw_are_said(trained):
    m = explain_model("tiny-ko", "Key€를 곱하면")
    assert m.unknown == 1 and m.tokens[3] == "€"
    assert "1" in m.to_text("ko") and "어휘에 없어서" in m.to_text("ko")
    long = explain_model("tiny-ko", "가" * 70 + "Score")
    assert len(long.tokens) == tiny.TinyConfig().context and long.cut == 75 - 64
    with pytest.raises(ModelError, match="non-empty"):
        explain_model("tiny-ko", "  ")


def test_the_shipped_text_reads_as_the_course_writes_korean():
    text = tiny.corpus()
    assert len(text) > 1000 and "Query" in text and "√d_k" in text and "head" in text
    for rx in (TRANSLITERATED, AWKWARD, WRONG_PARTICLE):
        assert not rx.search(text), rx.findall(text)


@needs_chromium
@pytest.mark.parametrize("lang", ["ko"])
def test_the_temperature_slider_recomputes_the_probabilities(browser, mt, tmp_path, lang):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    path = tmp_path / f"tiny_{lang}.html"
    assert main(["explain", "--model", "tiny-ko", "--lang", lang, "--html", str(path)]) == 0
    browser.get(path.as_uri())
    z = mt.logits[mt.focus[2] - 1]

    def read() -> dict[str, Any]:
        browser.execute_async_script(FRAMES)
        got = browser.execute_script(READ)
        assert got["errors"] == []
        want = next_probabilities(z, got["state"]["t"])                 # (V,)
        for r in got["rows"]:
            assert abs(r["p"] - want[r["j"]]) < 1e-12, (r, want[r["j"]])
        assert abs(got["rest"] - (1 - sum(r["p"] for r in got["rows"]))) < 1e-9
        assert abs(got["sum"] - 1) < 1e-9                                # all V of them
        return got

    start = read()
    assert start["state"] == {"slider": 50, "t": 1} and start["label"] == "T = 1.00"
    slider = browser.find_element(By.CSS_SELECTOR, ".nextv input.nx-t")
    slider.send_keys(*[Keys.ARROW_RIGHT] * 20)                           # T = 10^(20/30)
    hot = read()
    assert hot["state"]["slider"] == 70
    assert math.isclose(hot["state"]["t"], slider_temperature(70))
    assert hot["rows"][0]["p"] < start["rows"][0]["p"] - 0.05            # flatter
    slider.send_keys(Keys.END)                                           # T ≈ 46: near uniform
    flat = read()
    assert flat["rows"][0]["p"] < 3 / len(mt.vocab)
    slider.send_keys(Keys.HOME)                                          # T = 0: one-hot
    cold = read()
    assert cold["state"]["t"] == 0 and cold["rows"][0]["p"] == 1 and cold["rest"] == 0
    assert "one-hot" in cold["label"]
    shots = os.environ.get("ATTNKIT_SCREENSHOTS")
    for width in (1280, 360):
        browser.set_window_size(width, 1000)
        try:
            browser.get(path.as_uri())
            browser.execute_async_script(FRAMES)
            wide = browser.execute_script(
                "return [document.documentElement.scrollWidth, "
                "document.documentElement.clientWidth, "
                "document.querySelector('.nextv').getBoundingClientRect().right]")
            if shots:
                browser.execute_script("document.querySelector('.nextv').scrollIntoView()")
                browser.save_screenshot(str(Path(shots) / f"tiny_{lang}_{width}.png"))
        finally:
            browser.set_window_size(1200, 1600)
        assert wide[0] <= wide[1] + 1 and wide[2] <= wide[1] + 0.5, (width, wide)
