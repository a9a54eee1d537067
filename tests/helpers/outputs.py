"""What the command line and the page print for the built-in examples and lessons, captured
for the explain tests (test_examples.py, test_korean_terms.py)."""

from __future__ import annotations

import re

import pytest

from attnkit.cli import main
from attnkit.explain.examples import EXAMPLES


def printed(capsys: pytest.CaptureFixture[str], name: str, lang: str = "en") -> str:
    assert main(["explain", "--example", name, "--lang", lang, "--color", "never"]) == 0
    return capsys.readouterr().out


def korean_outputs(capsys) -> dict[str, str]:
    """Every Korean text the command line and the page show for the built-in examples and
    lessons, by name."""
    from attnkit.explain.html import render_html
    from attnkit.explain.lessons import LESSONS

    out = {}
    for name, ex in EXAMPLES.items():
        out[name] = printed(capsys, name, "ko")
        page = render_html(ex.traces(), lang="ko")
        out[name + " (page)"] = re.sub(r"<(script|style)>.*?</\1>|<[^>]+>", " ", page, flags=re.S)
        assert main(["explain", "--example", name, "--lang", "ko", "--scale", "1",
                     "--color", "never"]) == 0
        out[name + " --scale 1"] = capsys.readouterr().out
    assert main(["examples", "--lang", "ko"]) == 0
    out["examples"] = capsys.readouterr().out
    for name in LESSONS:
        assert main(["lesson", name, "--lang", "ko"]) == 0
        out["lesson " + name] = capsys.readouterr().out
    return out
