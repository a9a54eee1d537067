"""MkDocs hook: a Korean page's content (docs/*-ko.md, or a page whose front matter says
``lang: ko``) is wrapped in ``<div lang="ko">``, so stylesheets/ko.css keeps Korean words
whole (``word-break: keep-all``: no 라이/브러리) and a screen reader reads it as Korean. The
rest of the site stays ``lang="en"`` (theme.language)."""

from __future__ import annotations


def is_korean(page) -> bool:  # noqa: ANN001
    return page.meta.get("lang") == "ko" or page.file.src_uri.endswith("-ko.md")


def on_page_content(html: str, page, config, files) -> str:  # noqa: ANN001
    return f'<div lang="ko">\n{html}\n</div>' if is_korean(page) else html
