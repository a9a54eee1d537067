"""The native loader's switch(): the hot path's environment switches (ATTNKIT_NATIVE,
TRITON_INTERPRET) follow every way of setting them."""

from __future__ import annotations

import os

import pytest

from attnkit.backends import triton
from attnkit.backends.native import loader

NAME = "ATTNKIT_TEST_SWITCH"


@pytest.mark.parametrize("value, want", [("1", True), ("TRUE", True), (" yes ", True),
                                         ("on", True), ("0", False), ("False", False),
                                         ("no", False), ("OFF", False)])
def test_values_parse_as_on_or_off(monkeypatch: pytest.MonkeyPatch, value: str,
                                   want: bool) -> None:
    monkeypatch.setenv(NAME, value)
    assert loader.switch(NAME, not want) is want


def test_unset_or_unknown_gives_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NAME, raising=False)
    assert loader.switch(NAME, True) is True and loader.switch(NAME, False) is False
    monkeypatch.setenv(NAME, "maybe")
    assert loader.switch(NAME, True) is True and loader.switch(NAME, False) is False


def test_every_way_of_setting_is_seen_at_once() -> None:
    try:
        os.environ[NAME] = "1"
        assert loader.switch(NAME, False)
        os.environ[NAME] = "0"
        assert not loader.switch(NAME, True)
        del os.environ[NAME]
        assert loader.switch(NAME, True)
        os.putenv(NAME, "1")          # putenv alone does not change os.environ: not seen,
        assert not loader.switch(NAME, False)   # as os.environ.get would not see it either
    finally:
        os.environ.pop(NAME, None)
        os.unsetenv(NAME)


def test_a_replaced_environ_is_read_through_get(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "environ", {NAME: "on"})
    assert loader.switch(NAME, False)


def test_the_hot_path_switches_use_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton.interpreter_enabled()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not triton.interpreter_enabled()
    monkeypatch.setenv("ATTNKIT_NATIVE", "off")
    assert loader._switched_off() and loader.load() is None
    monkeypatch.setenv("ATTNKIT_NATIVE", "1")
    assert not loader._switched_off()
