"""Run the course notebooks top to bottom and save them with their outputs.

    python notebooks/execute.py          # both: course_ko.ipynb and course_en.ipynb

The saved outputs are what a reader sees before running anything (on GitHub, in Jupyter)
and what the documentation site renders (docs/hooks.py, ``<!-- notebook: … -->``);
tests/explain/test_notebooks.py runs the notebooks again and fails when the saved outputs
are not the ones a fresh run gives — printed text exactly, a Trace's page by its language,
title and values (not its CSS or script) — then run this script. Saved: stdout (one block a cell,
however the kernel split it) and results only — no stderr (the native kernel's one-time build
notes), no timings.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LANGS = ("ko", "en")


def execute(lang: str):  # noqa: ANN201 - an nbformat NotebookNode
    """The notebook ``course_{lang}.ipynb`` run in a fresh kernel, its outputs kept clean."""
    import nbclient
    import nbformat

    nb = nbformat.read(HERE / f"course_{lang}.ipynb", as_version=4)
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(HERE)}}).execute()
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        kept = []
        for o in cell.outputs:
            if o.output_type == "stream" and o.name == "stderr":
                continue
            if o.output_type == "stream" and kept and kept[-1].output_type == "stream":
                kept[-1].text += o.text              # one block, however the kernel split it
                continue
            kept.append(o)
        cell.outputs = kept
        cell.metadata.pop("execution", None)
    return nb


def main(langs: tuple[str, ...] = LANGS) -> None:
    import nbformat

    for lang in langs:
        nb = execute(lang)
        nbformat.write(nb, HERE / f"course_{lang}.ipynb")
        print(f"wrote notebooks/course_{lang}.ipynb", file=sys.stderr)


if __name__ == "__main__":
    main(tuple(sys.argv[1:]) or LANGS)
