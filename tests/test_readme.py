"""The README's Python snippets run as written (the transformers one is tested elsewhere)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
          if "transformers" not in b]


def test_readme_has_python_snippets():
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_snippets_run_in_order(i, capsys):
    env: dict = {}
    exec("import torch\nimport attnkit as ak\n" + "\n".join(BLOCKS[: i + 1]), env)  # noqa: S102
    assert "ak" in env
