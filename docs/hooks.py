"""MkDocs hooks: the parts of the site that are generated from the code at build time.

- A fenced block opened with ```` ```python show ```` is an example whose output the page
  shows: at build time every ```` ```python ```` block of that page runs in order in one
  namespace (as ``tests/test_docs.py`` runs them), and the stdout of each ``show`` block is
  put under it as a text block. Mask drawings, error messages and printed values on the
  site are the library's real output, never drawn by hand.
- ``<!-- cli-help: explain -->`` (or ``examples``, ``bench``, ``cost``, or nothing for the
  top level) becomes the ``--help`` text of that command, from its argument parser.

Both are plain functions (:func:`run_blocks`, :func:`cli_help`) that the tests call too.
"""

from __future__ import annotations

import contextlib
import io
import os
import re

PRELUDE = "import torch\nimport attnkit as ak\n"
BLOCK = re.compile(r"^```python( show)?[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
CLI = re.compile(r"^<!-- cli-help:\s*([a-z]*)\s*-->[ \t]*$", re.M)


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


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001
    markdown = _show_outputs(markdown, page.file.src_path)
    return CLI.sub(lambda m: "```text\n" + cli_help(m.group(1)) + "\n```", markdown)
