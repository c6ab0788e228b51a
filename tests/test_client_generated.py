"""The sync client is generated from the async one (scripts/unasync.py), never edited by
hand: the committed ``client/_sync.py`` must be exactly what the generator makes of
``client/_async.py``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "unasync.py"
CLIENT = ROOT / "src" / "interlock" / "client"


@pytest.fixture(scope="module")
def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_interlock_unasync", SCRIPT)
    assert spec is not None, f"no generator at {SCRIPT}"
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and the like look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_the_committed_sync_client_is_what_the_generator_makes(generator: ModuleType) -> None:
    generated = generator.unasync((CLIENT / "_async.py").read_text(encoding="utf-8"))
    committed = (CLIENT / "_sync.py").read_text(encoding="utf-8")
    assert committed == generated, (
        "src/interlock/client/_sync.py is not what scripts/unasync.py generates from "
        "_async.py (edited by hand, or _async.py changed since): edit _async.py, then run "
        "`python scripts/unasync.py`"
    )
    assert committed.startswith("# GENERATED from _async.py by scripts/unasync.py")


def test_the_generator_takes_out_async_and_await(generator: ModuleType) -> None:
    source = (
        "import contextlib\n"
        "import trio\n"
        "class AsyncClient:\n"
        "    async def __aenter__(self) -> AsyncClient:\n"
        "        async with contextlib.aclosing(self.stream()) as events:\n"
        "            async for event in events:\n"
        "                await trio.sleep(1)\n"
        "        await self._http.aclose()\n"
        "        return self\n"
    )
    assert generator.unasync(source) == generator.HEADER + (
        "import contextlib\n"
        "import time\n"
        "class Client:\n"
        "    def __enter__(self) -> Client:\n"
        "        with contextlib.closing(self.stream()) as events:\n"
        "            for event in events:\n"
        "                time.sleep(1)\n"
        "        self._http.close()\n"
        "        return self\n"
    )


def test_the_markers_keep_a_block_for_one_side(generator: ModuleType) -> None:
    source = (
        "# unasync: async-only\n"
        "async def f() -> None:\n"
        "    await trio.lowlevel.checkpoint()\n"
        "# unasync: end\n"
        "# unasync: sync-only\n"
        "# def f() -> None:\n"
        "#     pass\n"
        "# unasync: end\n"
        "from typing import AsyncIterator, Iterable\n"
    )
    assert generator.unasync(source) == generator.HEADER + (
        "def f() -> None:\n    pass\nfrom typing import Iterable, Iterator\n"
    )


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("x = trio.current_time()\n", r"_async.py:1: the sync line still says 'trio'"),
        ("# unasync: async-only\nx = 1\n", r"_async.py:1: the async-only block is never closed"),
        ("# unasync: end\n", r"_async.py:1: an '# unasync: end' with no block open"),
        ("# unasync: sync-only\nx = 1\n# unasync: end\n", r"must be commented out"),
    ],
)
def test_what_the_generator_cannot_convert_is_refused_naming_the_line(
    generator: ModuleType, source: str, says: str
) -> None:
    with pytest.raises(generator.UnasyncError, match=says):
        generator.unasync(source)
