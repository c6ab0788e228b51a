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
    hotpath = importlib.import_module("interlock.core._hotpath")
    compiled = importlib.import_module("interlock.core._hot")
    assert hotpath.IMPLEMENTATION == "compiled"
    assert hotpath.Tables is compiled.Tables
    assert hotpath.unframe is compiled.unframe


@pytest.mark.skipif(
    not NO_EXTENSIONS,
    reason="INTERLOCK_NO_EXTENSIONS is not set: the compiled hot path is expected",
)
def test_pure_hot_path_is_selected_without_extensions() -> None:
    hotpath = importlib.import_module("interlock.core._hotpath")
    python = importlib.import_module("interlock.core._hot_py")
    assert hotpath.IMPLEMENTATION == "python"
    assert hotpath.Tables is python.Tables


@pytest.mark.skipif(
    NO_EXTENSIONS, reason="INTERLOCK_NO_EXTENSIONS is set: the pure-Python decide path is expected"
)
def test_compiled_decide_path_is_selected_and_built_from_the_current_pyx() -> None:
    import pathlib

    view = importlib.import_module("interlock.core._view")
    decider = importlib.import_module("interlock.core._decider")
    compiled = importlib.import_module("interlock.core._decide")
    assert view.DECIDE_IMPLEMENTATION == "compiled"
    assert view.RunState is compiled.RunState
    assert decider._propose is compiled.on_propose
    # A stale build keeps running silently: the module must be newer than its source.
    pyx = pathlib.Path(__file__).parents[2] / "ext" / "_decide.pyx"
    if pyx.exists():
        built = pathlib.Path(compiled.__file__ or "")
        assert built.stat().st_mtime >= pyx.stat().st_mtime, (
            f"{built.name} is older than ext/_decide.pyx: rebuild it (pip install -e .)"
        )


@pytest.mark.skipif(
    not NO_EXTENSIONS,
    reason="INTERLOCK_NO_EXTENSIONS is not set: the compiled decide path is expected",
)
def test_pure_decide_path_is_selected_without_extensions() -> None:
    view = importlib.import_module("interlock.core._view")
    decider = importlib.import_module("interlock.core._decider")
    assert view.DECIDE_IMPLEMENTATION == "python"
    assert view.RunState is view.PyRunState
    assert decider._propose is decider._on_propose
    assert decider._report is decider._on_report
