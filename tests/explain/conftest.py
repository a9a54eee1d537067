"""One headless Chromium for every browser test of tests/explain (see webpage.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from webpage import start_driver


@pytest.fixture(scope="session")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    yield from start_driver(str(tmp_path_factory.mktemp("profile")))
