"""The public surface: ``__all__`` is complete and true, and names come from interlock."""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys
import types
from typing import Any

import pytest

import interlock
import interlock.client
import interlock.errors
import interlock.events
import interlock.gateway
import interlock.messages
import interlock.metrics
import interlock.protocol
import interlock.providers
import interlock.stores
import interlock.testing
from interlock import _version

PUBLIC_MODULES = [
    interlock,
    interlock.client,
    interlock.errors,
    interlock.events,
    interlock.gateway,
    interlock.messages,
    interlock.metrics,
    interlock.protocol,
    interlock.providers,
    interlock.stores,
    interlock.testing,
]


def _public_attributes(module: types.ModuleType) -> set[str]:
    lazy = set(getattr(module, "_LAZY", ()))  # resolved by the module's __getattr__
    return lazy | {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and getattr(value, "__module__", None) != "typing"  # Any, Final, ... imported
        and name != "annotations"  # from __future__ import annotations
    }


@pytest.mark.parametrize("module", PUBLIC_MODULES, ids=lambda m: m.__name__)
def test_all_names_exist_and_are_unique(module: types.ModuleType) -> None:
    names = module.__all__
    assert len(names) == len(set(names))
    missing = [name for name in names if not hasattr(module, name)]
    assert missing == []


@pytest.mark.parametrize("module", PUBLIC_MODULES, ids=lambda m: m.__name__)
def test_all_is_complete(module: types.ModuleType) -> None:
    assert _public_attributes(module) == set(module.__all__) - {"__version__"}


def _public_objects() -> list[Any]:
    return [
        pytest.param(getattr(module, name), id=f"{module.__name__}.{name}")
        for module in PUBLIC_MODULES
        for name in module.__all__
        if inspect.isclass(getattr(module, name)) or inspect.isfunction(getattr(module, name))
    ]


@pytest.mark.parametrize("obj", _public_objects())
def test_public_names_are_defined_in_interlock(obj: Any) -> None:
    assert obj.__module__.startswith("interlock")


@pytest.mark.parametrize("obj", _public_objects())
def test_public_names_are_documented(obj: Any) -> None:
    assert inspect.getdoc(obj)


def test_version() -> None:
    assert "__version__" in interlock.__all__
    assert interlock.__version__ == _version.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+(?:[.-]?\w+)*", interlock.__version__)


def test_the_cli_and_the_sqlite_store_do_not_import_psycopg() -> None:
    # psycopg costs ~0.3 s to import; only a PostgreSQL store should pay it.
    code = (
        "import sys, interlock, interlock.stores, interlock.cli\n"
        "assert 'psycopg' not in sys.modules, 'psycopg was imported'\n"
        "interlock.stores.PostgresStore\n"
        "assert 'psycopg' in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_help_renders_the_whole_package() -> None:
    """help(interlock) and `python -m pydoc interlock` used to fail: NameError: name 'Tool'
    is not defined, from interlock.Decision's annotations (#15)."""
    import pydoc

    text = pydoc.render_doc(interlock, renderer=pydoc.plaintext)
    assert "class Supervisor" in text
    assert "class RunView" in text
    assert "open_supervisor" in text


@pytest.mark.parametrize("name", ["RunState", "Decision", "CircuitBoard", "verify", "fold"])
def test_mutable_internals_are_private_and_say_what_to_use(name: str) -> None:
    """RunState, Decision and CircuitBoard hold the runtime's mutable state; they, and the
    functions that hand them out, are not public, and asking for one says what to use (#15)."""
    assert name not in interlock.__all__
    with pytest.raises(AttributeError, match=rf"^interlock\.{name} is internal .*; \w"):
        getattr(interlock, name)
    for obj in _public_objects():
        value = obj.values[0]
        hints = getattr(value, "__annotations__", {})
        assert name not in {getattr(h, "__name__", h) for h in hints.values()}, value


def test_the_message_union_is_exported_with_every_message_in_it() -> None:
    """The union and the messages it holds are exported together, or not at all (#15)."""
    import typing

    for union in (interlock.messages.Message, interlock.messages.Request):
        for cls in typing.get_args(union):
            assert getattr(interlock.messages, cls.__name__) is cls
            assert cls.__name__ in interlock.messages.__all__


def test_the_top_level_is_what_an_application_imports() -> None:
    """About 60 names: machines, tools, running and replaying them, and the errors an
    application catches; events, messages, metrics and the rest have their own modules."""
    assert 40 <= len(interlock.__all__) <= 65, len(interlock.__all__)
    for name in ("Machine", "Tool", "Worker", "open_supervisor", "replay", "InterlockError"):
        assert name in interlock.__all__
    for name in ("ToolCommitted", "Propose", "RuntimeStats", "JournalCorrupt"):
        assert name not in interlock.__all__


def test_help_reads_like_a_table_of_contents() -> None:
    doc = interlock.__doc__ or ""
    listed = set(re.findall(r"\b[A-Za-z_]\w*\b", doc.split("And in their own modules")[0]))
    missing = sorted(set(interlock.__all__) - {"__version__"} - listed)
    assert missing == [], f"interlock's docstring does not list: {missing}"


def test_each_public_name_means_one_thing_everywhere() -> None:
    seen: dict[str, tuple[str, Any]] = {}
    for module in PUBLIC_MODULES:
        for name in module.__all__:
            if name == "__version__":
                continue
            value = getattr(module, name)
            if name in seen:
                where, other = seen[name]
                assert value is other, (
                    f"{name} means one thing in {where}, another in {module.__name__}"
                )
            else:
                seen[name] = (module.__name__, value)


@pytest.mark.parametrize(
    ("name", "home"),
    [
        ("ToolCommitted", "interlock.events"),
        ("Propose", "interlock.messages"),
        ("JournalCorrupt", "interlock.errors"),
        ("RuntimeStats", "interlock.metrics"),
    ],
)
def test_a_name_that_moved_says_where_it_is_now(name: str, home: str) -> None:
    with pytest.raises(AttributeError, match=rf"from {re.escape(home)} import {name}"):
        getattr(interlock, name)
    assert name in importlib.import_module(home).__all__
