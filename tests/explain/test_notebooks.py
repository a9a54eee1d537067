"""The companion notebooks (Korean, with an English twin) run top to bottom, so they never go
stale; and a Trace renders itself in Jupyter (``_repr_html_``)."""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest
import torch

import attnkit as ak

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


@pytest.mark.parametrize("lang", ["ko", "en"])
def test_notebook_runs(lang):
    nbformat = pytest.importorskip("nbformat", reason="pip install -r requirements-dev.txt")
    nbclient = pytest.importorskip("nbclient", reason="pip install -r requirements-dev.txt")
    pytest.importorskip("ipykernel", reason="pip install -r requirements-dev.txt")
    nb = nbformat.read(NOTEBOOKS / f"course_{lang}.ipynb", as_version=4)
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs)
    assert "Softmax" in text and "0.506" in text
    pages = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
    assert any("<iframe srcdoc=" in p for p in pages)                  # the trace's page
    if lang == "ko":                # the interactive cell is the Korean page (was lang="en")
        assert all('lang=&quot;ko&quot;' in p and "Try it" not in p for p in pages)
        assert "분산" in text and "가중치" in text
        prose = text + "".join(c.source for c in nb.cells if c.cell_type == "markdown")
        for word in ("소프트맥스", "마스크", "쿼리", "점수"):     # the course's terms are Latin
            assert word not in prose, word


def test_trace_repr_html_is_its_page_in_an_iframe():
    q = torch.randn(3, 4, dtype=torch.float64)
    tr = ak.explain(q, q, q, is_causal=True)
    out = tr._repr_html_()
    m = re.fullmatch(r'<iframe srcdoc="(.*)" title="attnkit explain" style="[^"]*"></iframe>',
                     out, re.S)
    assert m and html.unescape(m.group(1)) == tr.to_html()
