"""The companion notebooks (Korean, with an English twin) run top to bottom, so they never go
stale; the outputs saved in them (which the docs site renders) are the ones a fresh run gives
(``python notebooks/execute.py`` saves them); and a Trace renders itself in Jupyter
(``_repr_html_``)."""

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
    saved = [_kept(c.get("outputs", [])) for c in nb.cells if c.cell_type == "code"]
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    fresh = [_kept(c.get("outputs", [])) for c in nb.cells if c.cell_type == "code"]
    assert saved == fresh, (f"notebooks/course_{lang}.ipynb: the saved outputs are stale "
                            "(the docs site shows them): run python notebooks/execute.py")
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


def _page_content(page: str) -> tuple:
    """A Trace's page (an iframe's srcdoc) as what it says: its language, title and every
    value it shows — not its markup, CSS or script, so that restyling the page does not make
    the saved notebooks stale, while a changed number does."""
    doc = html.unescape(page)
    return (re.findall(r'<html lang="(\w+)"', doc), re.findall(r"<title>(.*?)</title>", doc),
            re.findall(r'data-v="([^"]*)"', doc),
            re.findall(r'class="pl-data">(.*?)</script>', doc, re.S))


def _kept(outputs: list) -> list:
    """What notebooks/execute.py saves of a cell's outputs: no stderr (the native kernel's
    one-time build notes), no execution counts, and one stdout block where the kernel sent
    the text in chunks (how it splits them depends on timing); a page by its content."""
    kept: list[dict] = []
    for o in outputs:
        if o.get("output_type") == "stream":
            if o.get("name") == "stderr":
                continue
            if kept and kept[-1].get("output_type") == "stream":
                kept[-1]["text"] += o["text"]
                continue
        o = {k: v for k, v in o.items() if k not in ("execution_count", "metadata")}
        if "text/html" in o.get("data", {}):
            o["data"] = {**o["data"], "text/html": _page_content(o["data"]["text/html"])}
        kept.append(o)
    return kept


def test_saved_outputs_are_there_for_the_docs_site():
    nbformat = pytest.importorskip("nbformat", reason="pip install -r requirements-dev.txt")
    for lang in ("ko", "en"):
        nb = nbformat.read(NOTEBOOKS / f"course_{lang}.ipynb", as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(c.get("outputs") or "import" in c.source for c in code), lang
        assert not any(o.get("name") == "stderr" for c in code for o in c.outputs), lang
        pages = [o.data["text/html"] for c in code for o in c.outputs
                 if "text/html" in o.get("data", {})]
        langs, titles, values, data = _page_content(pages[0])
        assert langs == [lang] and titles and "0.506" in values and len(data) == 1


def test_trace_repr_html_is_its_page_in_an_iframe():
    q = torch.randn(3, 4, dtype=torch.float64)
    tr = ak.explain(q, q, q, is_causal=True)
    out = tr._repr_html_()
    m = re.fullmatch(r'<iframe srcdoc="(.*)" title="attnkit explain" style="[^"]*"></iframe>',
                     out, re.S)
    assert m and html.unescape(m.group(1)) == tr.to_html()
