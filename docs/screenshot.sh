#!/usr/bin/env bash
# Re-take the explain page screenshots on this site (run from the repository root):
#   bash docs/screenshot.sh
# Writes docs/explain-page.png (English) and docs/explain-page-ko.png (Korean) from the page
# that `attnkit explain --html` writes, rendered by headless Chromium (Debian's `chromium`),
# and docs/explain-playground-wide.png (the √d_k example's playground; needs selenium).
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
# The playground of the √d_k example (d_k = 64: Q and K as strips), as an element screenshot.
"$BIN/attnkit" explain --example scaling --html "$tmp/scaling.html" >/dev/null
SE_OFFLINE=true "$BIN/python" - "$tmp/scaling.html" "$PWD/docs/explain-playground-wide.png" <<'PY'
import shutil
import sys

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

opts = webdriver.ChromeOptions()
opts.binary_location = shutil.which("chromium")
for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--window-size=1100,1400"):
    opts.add_argument(flag)
driver = webdriver.Chrome(options=opts,                  # Debian's chromium-driver, offline
                          service=Service(executable_path=shutil.which("chromedriver")))
try:
    driver.get("file://" + sys.argv[1])
    driver.find_element("css selector", "#play1").screenshot(sys.argv[2])
finally:
    driver.quit()
PY
ls -l docs/explain-playground-wide.png
