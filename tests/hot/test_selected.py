"""A normal install really runs the compiled hot path."""

from __future__ import annotations

import importlib
import os

import pytest

NO_EXTENSIONS = bool(os.environ.get("INTERLOCK_NO_EXTENSIONS"))


@pytest.mark.skipif(
    NO_EXTENSIONS, reason="INTERLOCK_NO_EXTENSIONS is set: the pure-Python hot path is expected"
)
def test_compiled_hot_path_is_selected() -> None:
    hotpath = importlib.import_module("interlock._hotpath")
    compiled = importlib.import_module("interlock._hot")
    assert hotpath.IMPLEMENTATION == "compiled"
    assert hotpath.Tables is compiled.Tables
    assert hotpath.unframe is compiled.unframe


@pytest.mark.skipif(
    not NO_EXTENSIONS,
    reason="INTERLOCK_NO_EXTENSIONS is not set: the compiled hot path is expected",
)
def test_pure_hot_path_is_selected_without_extensions() -> None:
    hotpath = importlib.import_module("interlock._hotpath")
    python = importlib.import_module("interlock._hot_py")
    assert hotpath.IMPLEMENTATION == "python"
    assert hotpath.Tables is python.Tables
