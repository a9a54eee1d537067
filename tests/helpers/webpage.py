"""Shared by the browser tests: where Chromium is, its flags, and one driver per run.

Each browser test module has a ``browser`` fixture that calls :func:`shared_driver`::

    @pytest.fixture(scope="module")
    def browser(tmp_path_factory):
        return shared_driver(str(tmp_path_factory.getbasetemp() / "chromium-profile"))

The browser tests need Debian's chromium and chromium-driver (``.ci/setup-system`` installs
them) and selenium (requirements-dev.txt); they skip only where chromium is absent.
"""

from __future__ import annotations

import atexit
import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--window-size=1200,1600"]
MISSING = ("chromium is not installed: apt-get install chromium chromium-driver "
           "(.ci/setup-system does this in CI)")


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


needs_chromium = pytest.mark.skipif(find_chromium() is None, reason=MISSING)


_DRIVER: list[Any] = []


def shared_driver(profile: str) -> Any:
    """One headless Chromium for the whole run (every browser test module asks for it here;
    it quits when the test process exits)."""
    if not _DRIVER:
        gen = start_driver(profile)
        _DRIVER.append(next(gen))
        atexit.register(gen.close)
    return _DRIVER[0]


def start_driver(profile: str) -> Iterator[Any]:
    """A headless Chromium driven by selenium (offline: selenium downloads nothing)."""
    chromium = find_chromium()
    if chromium is None:
        pytest.skip(MISSING)
    driver_path = shutil.which("chromedriver")
    if driver_path is None:
        pytest.skip("chromedriver is not installed: apt-get install chromium-driver")
    pytest.importorskip("selenium", reason='the browser tests need selenium: '
                        'pip install "attnkit[browser]"')
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")          # selenium must not download anything
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={profile}")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=driver_path))
    try:
        yield driver
    finally:
        driver.quit()
