"""The ``hot`` fixture: each hot-path test runs once per implementation."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest
from hypothesis import strategies as st

NO_EXTENSIONS = bool(os.environ.get("INTERLOCK_NO_EXTENSIONS"))


def _import_hot(name: str) -> ModuleType:
    if name == "interlock.core._hot":
        if NO_EXTENSIONS:
            pytest.skip("INTERLOCK_NO_EXTENSIONS is set: the compiled hot path is disabled")
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            pytest.skip(
                f"interlock.core._hot cannot be imported ({exc}); "
                "build it with `python setup.py build_ext --inplace`"
            )
    return importlib.import_module(name)


@pytest.fixture(
    scope="session",
    params=[
        pytest.param("interlock.core._hot", id="hot-compiled", marks=pytest.mark.c_extension),
        pytest.param("interlock.core._hot_py", id="hot-python"),
    ],
)
def hot(request: pytest.FixtureRequest) -> ModuleType:
    """The compiled hot path (``interlock.core._hot``) or its pure-Python twin (``interlock.core._hot_py``)."""
    return _import_hot(request.param)


#: Bytes that often form JSON, or nearly: structure, escapes (lone surrogates included),
#: digits, multi-byte characters. Joined by hypothesis into documents that are JSON or
#: nearly (see near_json), for the scanner's properties and the twins' parity.
JSON_TOKENS = (
    *'{}[],:"',
    "\\",
    '"a"',
    '"a":',
    "1",
    "0",
    "-",
    ".",
    "e",
    "true",
    "nul",
    " ",
    "\\u00e9",
    "\\ud800",
    "\\udc00",
    "\\u0061",
    "é",
    "😀",
    "\n",
    "\\n",
    "\t",
)


def near_json(max_size: int) -> st.SearchStrategy[bytes]:
    """Documents of up to ``max_size`` JSON_TOKENS."""
    return st.lists(st.sampled_from(JSON_TOKENS), max_size=max_size).map(
        lambda parts: "".join(parts).encode()
    )
