#!/usr/bin/env bash
# Re-take the explain page screenshots on this site (run from the repository root):
#   bash docs/screenshot.sh
# Writes docs/explain-page.png (English) and docs/explain-page-ko.png (Korean) from the page
# that `attnkit explain --html` writes, rendered by headless Chromium (Debian's `chromium`).
set -euo pipefail
BIN="${BIN:-.venv/bin}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for lang in en ko; do
  suffix=$([ "$lang" = en ] && echo "" || echo "-$lang")
  "$BIN/attnkit" explain --lang "$lang" --html "$tmp/page$suffix.html" >/dev/null
  chromium --headless --no-sandbox --disable-gpu --hide-scrollbars \
    --window-size=1280,1500 --screenshot="$PWD/docs/explain-page$suffix.png" \
    "file://$tmp/page$suffix.html" 2>/dev/null
done
ls -l docs/explain-page*.png
