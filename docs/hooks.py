"""MkDocs hooks: the parts of the site that are generated from the code at build time.

- A fenced block opened with ```` ```python show ```` is an example whose output the page
  shows: at build time every ```` ```python ```` block of that page runs in order in one
  namespace (as ``tests/test_docs.py`` runs them), and the stdout of each ``show`` block is
  put under it as a text block. Mask drawings, error messages and printed values on the
  site are the library's real output, never drawn by hand.
- ``<!-- cli-help: explain -->`` (or ``examples``, ``bench``, ``cost``, or nothing for the
  top level) becomes the ``--help`` text of that command, from its argument parser.

- ``<!-- notebook: course_en.ipynb -->`` becomes that notebook of ``notebooks/`` as Markdown
  (:func:`notebook_markdown`): its text cells, its code, and the outputs saved in it — text
  as text blocks, a Trace's interactive page (``text/html``) as itself, images inline. The
  saved outputs are a real run's (``python notebooks/execute.py`` writes them, and
  ``tests/explain/test_notebooks.py`` fails when they are stale), so the site needs no
  Jupyter kernel and no plugin: nbformat's JSON is read directly.

All are plain functions (:func:`run_blocks`, :func:`cli_help`, :func:`notebook_markdown`)
that the tests call too.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
from pathlib import Path

PRELUDE = "import torch\nimport attnkit as ak\n"
BLOCK = re.compile(r"^```python( show)?[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
CLI = re.compile(r"^<!-- cli-help:\s*([a-z-]*)\s*-->[ \t]*$", re.M)
NOTEBOOK = re.compile(r"^<!-- notebook:\s*(\S+\.ipynb)\s*-->[ \t]*$", re.M)
NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def python_blocks(markdown: str) -> list[tuple[bool, str]]:
    """(is a ``show`` block, code) for every ```` ```python ```` block, in page order."""
    return [(bool(m.group(1)), m.group(2)) for m in BLOCK.finditer(markdown)]


def run_blocks(markdown: str, name: str = "<docs>") -> list[str]:
    """Run a page's python blocks in order in one namespace; the stdout of each block."""
    env: dict = {"__name__": "__docs__"}
    exec(PRELUDE, env)  # noqa: S102
    outs = []
    for i, (_, code) in enumerate(python_blocks(markdown)):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(compile(code, f"{name}[block {i + 1}]", "exec"), env)  # noqa: S102
        outs.append(buf.getvalue())
    return outs


def cli_help(command: str = "") -> str:
    """``attnkit [command] --help``, as its parser prints it (80 columns wide)."""
    from attnkit.cli import main

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "80"
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
            main([command, "--help"] if command else ["--help"])
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old
    return buf.getvalue().rstrip()


def _show_outputs(markdown: str, name: str) -> str:
    blocks = list(BLOCK.finditer(markdown))
    if not any(m.group(1) for m in blocks):
        return markdown
    outs = run_blocks(markdown, name)
    parts, last = [], 0
    for m, out in zip(blocks, outs, strict=True):
        parts.append(markdown[last:m.start()])
        parts.append(f"```python\n{m.group(2)}```")
        if m.group(1):
            parts.append("\n\nOutput:\n\n```text\n" + (out.rstrip() or "(nothing printed)")
                         + "\n```")
        last = m.end()
    parts.append(markdown[last:])
    return "".join(parts)


def _text(x: str | list[str]) -> str:
    return "".join(x) if isinstance(x, list) else x


def _fence(text: str, lang: str = "text") -> str:
    """A fenced block that no line of ``text`` can close (a longer fence when needed)."""
    ticks = max([3] + [len(m) + 1 for m in re.findall(r"^`{3,}", text, re.M)])
    return f"{'`' * ticks}{lang}\n{text.rstrip()}\n{'`' * ticks}"


def _output_markdown(out: dict) -> str | None:
    kind = out.get("output_type")
    if kind == "stream":
        return _fence(ANSI.sub("", _text(out.get("text", "")))) if out.get("name") != "stderr" \
            else None
    if kind == "error":
        return _fence(ANSI.sub("", "\n".join(out.get("traceback", []))))
    data = out.get("data", {})
    if "text/html" in data:                          # a Trace's page: its iframe, as is
        return f'<div class="nb-output">\n{_text(data["text/html"]).strip()}\n</div>'
    for mime in ("image/png", "image/jpeg"):
        if mime in data:
            b64 = "".join(_text(data[mime]).split())
            return f'<div class="nb-output"><img alt="output" src="data:{mime};base64,{b64}"></div>'
    if "text/plain" in data:
        return _fence(_text(data["text/plain"]))
    return None


def notebook_markdown(name: str) -> str:
    """``notebooks/<name>`` as Markdown, with the outputs saved in it (see the module doc).

    The notebook's headings move one level down: the page that includes it has its own title.
    """
    nb = json.loads((NOTEBOOKS / name).read_text(encoding="utf-8"))
    parts = []
    for cell in nb["cells"]:
        src = _text(cell.get("source", "")).strip()
        if cell["cell_type"] == "markdown":
            parts.append(re.sub(r"^(#{1,5}) ", r"#\1 ", src, flags=re.M))
        elif cell["cell_type"] == "code":
            parts.append(_fence(src, "python"))
            outs = [o for o in map(_output_markdown, cell.get("outputs", [])) if o]
            parts += outs
    return "\n\n".join(parts) + "\n"


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001
    markdown = _show_outputs(markdown, page.file.src_path)
    markdown = CLI.sub(lambda m: "```text\n" + cli_help(m.group(1)) + "\n```", markdown)
    return NOTEBOOK.sub(lambda m: notebook_markdown(m.group(1)), markdown)
