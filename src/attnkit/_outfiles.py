"""Where the command line may write: never over an input, never one file for two outputs,
and an existing file only when it is an earlier output of the same kind (or with --force).

``attnkit explain`` (``--html``, ``--plot``), ``attnkit lesson --plot`` and ``attnkit bench``
(``--json``, ``--plot``) check every output path with :func:`output_problem` before any work.
An earlier output is recognised by what attnkit writes into it:

    HTML   ``<meta name="generator" content="attnkit">`` in the head (or, on pages from before
           that tag, the "Made by attnkit" footer in either language)
    PNG    a ``tEXt`` chunk ``Software`` = ``attnkit …`` (:data:`PNG_METADATA`, given to
           ``savefig``); a PNG drawn before that stamp needs ``--force`` once
    JSON   ``attnkit bench``'s records: an object with ``meta`` (torch, threads) and ``rows``

The messages (English and Korean) are :data:`MESSAGES`, merged into the explain tables.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["GENERATOR_META", "PNG_METADATA", "MESSAGES", "output_problem", "message",
           "looks_like", "savefig_kwargs"]

GENERATOR_META = '<meta name="generator" content="attnkit">'
PNG_METADATA = {"Software": "attnkit (matplotlib)"}
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_STAMP = b"tEXtSoftware\x00attnkit"
_FOOTERS = ("Made by attnkit", "attnkit으로 만든")      # strings.page_generated, en / ko
_MAX_JSON_BYTES = 64 * 2 ** 20
_MAX_PAGE_BYTES = 64 * 2 ** 20

KINDS = {"html": "HTML", "png": "PNG", "json": "JSON"}

MESSAGES: dict[str, dict[str, str]] = {
    "en": {
        "out_is_input": "{flag} {path} is also the {inp} input: attnkit never writes over "
                        "its inputs; give the output another name (e.g. {suggest})",
        "out_twice": "{a} and {b} both name {path}: give each output its own file",
        "out_exists": "{flag} {path} already exists and is not {kind} output of attnkit: not "
                      "replacing it; give another name, or add --force to replace it",
    },
    "ko": {
        "out_is_input": "{flag} {path}: {inp} 입력으로 읽는 파일입니다. attnkit은 입력 파일을 "
                        "덮어쓰지 않으니, 출력 파일 이름을 따로 정해 주세요 (예: {suggest})",
        "out_twice": "{a}, {b} 두 출력이 같은 파일({path})을 가리킵니다: 출력마다 다른 파일 "
                     "이름을 주세요",
        "out_exists": "{flag} {path}: 이미 있는 파일인데, attnkit이 만든 {kind} 출력이 "
                      "아니어서 덮어쓰지 않았습니다. 다른 이름을 쓰거나, 덮어쓰려면 --force를 "
                      "붙이세요",
    },
}


def _same_file(a: str, b: str) -> bool:
    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
    except OSError:
        pass
    return os.path.normcase(os.path.realpath(a)) == os.path.normcase(os.path.realpath(b))


def _head(path: Path, n: int) -> bytes:
    with path.open("rb") as f:
        return f.read(n)


def looks_like(path: str | Path, kind: str) -> bool:
    """Whether the existing file ``path`` is an earlier attnkit output of ``kind``
    (``"html"``, ``"png"`` or ``"json"``, see the module docstring)."""
    p = Path(path)
    try:
        if kind == "html":
            head = _head(p, 4096).decode("utf-8", "replace")
            if not head.lstrip().lower().startswith("<!doctype html>"):
                return False
            if GENERATOR_META in head:
                return True
            if p.stat().st_size > _MAX_PAGE_BYTES:        # an older page: its footer
                return False
            text = p.read_bytes().decode("utf-8", "replace")
            return any(f"<footer>{s}" in text for s in _FOOTERS)
        if kind == "png":
            head = _head(p, 65536)                        # text chunks come before IDAT
            return head.startswith(_PNG_SIGNATURE) and _PNG_STAMP in head
        if kind == "json":
            if p.stat().st_size > _MAX_JSON_BYTES:
                return False
            data = json.loads(p.read_text(encoding="utf-8"))
            return (isinstance(data, dict) and isinstance(data.get("meta"), dict)
                    and isinstance(data.get("rows"), list)
                    and {"torch", "threads"} <= data["meta"].keys())
    except (OSError, ValueError):
        return False
    raise ValueError(f"unknown output kind {kind!r}")


def output_problem(flag: str, path: str | None, kind: str, *,
                   inputs: Sequence[tuple[str, str | None]] = (),
                   earlier: Sequence[tuple[str, str | None]] = (),
                   force: bool = False) -> tuple[str, dict[str, str]] | None:
    """Why the output ``flag path`` (of ``kind``) must not be written, as ``(message key,
    params)``, or None when it may.

    ``inputs``: ``(flag, path)`` of the files the command reads (never written over, even
    with ``force``); ``earlier``: the outputs already checked (one file, one output);
    ``force``: replace an existing file that is not an earlier output of ``kind``.
    """
    if not path:
        return None
    for inp_flag, inp in inputs:
        if inp and _same_file(path, inp):
            ext = {"html": ".html", "png": ".png", "json": ".json"}[kind]
            suggest = str(Path(path).with_suffix(ext))
            if _same_file(suggest, inp):
                suggest = str(Path(path).with_name(Path(path).stem + "-out" + ext))
            return "out_is_input", {"flag": flag, "path": path, "inp": inp_flag,
                                    "suggest": suggest}
    for other_flag, other in earlier:
        if other and _same_file(path, other):
            return "out_twice", {"a": other_flag, "b": flag, "path": path}
    if not force and os.path.isfile(path) and not looks_like(path, kind):
        return "out_exists", {"flag": flag, "path": path, "kind": KINDS[kind]}
    return None


def savefig_kwargs(path: str | Path, fmt: str | None = None) -> dict[str, object]:
    """``savefig``'s ``metadata`` stamp for a PNG (other formats take other keys: none)."""
    png = (fmt or Path(path).suffix.lstrip(".")).lower() == "png"
    return {"metadata": dict(PNG_METADATA)} if png else {}


def message(problem: tuple[str, dict[str, str]], lang: str = "en") -> str:
    key, params = problem
    return MESSAGES.get(lang, MESSAGES["en"])[key].format(**params)
