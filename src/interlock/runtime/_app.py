"""Applications: what a project hands interlock, and how the command line finds one."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core._exceptions import AppRefError, ConfigurationError, LifespanError
from ..core._machine import Machine

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from contextlib import AbstractAsyncContextManager

    from ..providers import Provider

#: The application a command that needs machines uses when none is named.
DEMO_REF = "interlock.demo:app"


class App:
    """An application: the machines a project runs, with their provider(s) and prices.

    The command line finds one by reference (``--app module:attribute`` or
    ``--app path/to/file.py:attribute``, else ``INTERLOCK_APP``, else ``app = "..."`` under
    ``[tool.interlock]`` in ``pyproject.toml``) and runs its machines for ``resume``,
    ``escalations resume|abort`` and ``replay``.

    Args:
      machines: the machines, at least one, with distinct names.
      provider: the provider of every worker state, or one per machine name.
      prices: USD per million tokens, ``(prompt, completion)``, by model name (the cost metric).
      store: the default journal, a SQLite path or ``postgresql://`` DSN, used when a
        command is given no ``--db``.
      lifespan: called with the journal's URL around every command that runs the machines;
        the async context manager it returns opens what the tools need and closes it.

    Raises:
      ConfigurationError: an argument is not what it must be (the message names it).
    """

    def __init__(
        self,
        machines: Sequence[Machine] | Machine,
        *,
        provider: Provider | Mapping[str, Provider] | None = None,
        prices: Mapping[str, tuple[float, float]] | None = None,
        store: str | None = None,
        lifespan: Callable[[str], AbstractAsyncContextManager[object]] | None = None,
    ) -> None:
        items = [machines] if isinstance(machines, Machine) else list(machines)
        if not items:
            raise ConfigurationError("App needs at least one Machine; pass App([machine, ...])")
        by_name: dict[str, Machine] = {}
        for item in items:
            if not isinstance(item, Machine):
                raise ConfigurationError(
                    f"App machines must be Machines, got {_a(type(item).__name__)}; "
                    "pass App([machine, ...])"
                )
            if item.name in by_name:
                raise ConfigurationError(
                    f"App has two machines named {item.name!r}; give each machine its own name"
                )
            by_name[item.name] = item
        if isinstance(provider, Mapping):
            unknown = sorted(set(provider) - set(by_name))
            if unknown:
                raise ConfigurationError(
                    f"App provider is given for machine {unknown[0]!r}, which the app does not "
                    f"have; its machines: {', '.join(by_name)}"
                )
        elif provider is not None and not callable(getattr(provider, "propose", None)):
            raise ConfigurationError(
                f"App provider must have an async propose(view), got {_a(type(provider).__name__)}"
            )
        for model, price in (prices or {}).items():
            if not (
                isinstance(price, tuple)
                and len(price) == 2
                and all(isinstance(p, int | float) and p >= 0 for p in price)
            ):
                raise ConfigurationError(
                    f"App prices[{model!r}] must be (prompt, completion) USD per million "
                    f"tokens, both at least 0; got {price!r}"
                )
        if lifespan is not None and not callable(lifespan):
            raise ConfigurationError(
                f"App lifespan must be a function of the journal's URL returning an async "
                f"context manager, got {_a(type(lifespan).__name__)}"
            )
        if store is not None and (not isinstance(store, str) or not store):
            raise ConfigurationError(
                f"App store must be a SQLite path or postgresql:// DSN, got {store!r}"
            )
        self.machines: dict[str, Machine] = by_name
        self.provider = provider
        self.prices = dict(prices or {})
        self.store = store
        self.lifespan = lifespan

    def __repr__(self) -> str:
        return f"App([{', '.join(self.machines)}])"

    def open(self, db: str, named: str = "") -> AbstractAsyncContextManager[object]:
        """Enter the app's lifespan for the journal ``db`` (nothing, without one).

        A lifespan that raises while it opens or closes, or returns no async context
        manager, raises LifespanError naming it (``named`` says which app), so a command
        ends with one line; an error of the block itself passes through unchanged.
        """
        return _Lifespan(self, db, named or repr(self))


class _Lifespan:
    def __init__(self, app: App, db: str, named: str) -> None:
        self.app, self.db, self.named = app, db, named
        self.entered: AbstractAsyncContextManager[object] | None = None

    async def __aenter__(self) -> object:
        if self.app.lifespan is None:
            return None
        what = f"the app {self.named}: its lifespan"
        try:
            manager = self.app.lifespan(self.db)
        except Exception as exc:
            raise LifespanError(f"{what} raised {_said(exc)}; fix it") from exc
        if not callable(getattr(manager, "__aenter__", None)):
            raise LifespanError(
                f"{what} returned {_a(type(manager).__name__)}, not an async context manager; "
                "decorate it with @contextlib.asynccontextmanager"
            )
        try:
            value = await manager.__aenter__()
        except Exception as exc:
            raise LifespanError(f"{what} raised {_said(exc)} while opening; fix it") from exc
        self.entered = manager
        return value

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        if self.entered is None:
            return None
        try:
            return await self.entered.__aexit__(*exc_info)
        except Exception as exc:
            if exc is exc_info[1]:
                raise
            raise LifespanError(
                f"the app {self.named}: its lifespan raised {_said(exc)} while closing; fix it"
            ) from exc


def _a(noun: str) -> str:
    return ("an " if noun[:1].lower() in "aeiou" else "a ") + noun


def _said(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def find_ref(flag: str | None, cwd: Path | None = None) -> tuple[str, str, Path | None]:
    """Return ``(where, ref, base)``: the named application, where it was named, and the
    directory a relative REF is read from (None: the current directory).

    ``flag`` (``--app``) wins, then ``INTERLOCK_APP``, then ``[tool.interlock] app`` in the
    ``pyproject.toml`` of ``cwd`` or its nearest parent that has one (a REF there is read
    from that file's directory, so it works from anywhere in the project); else the demo.
    """
    if flag:
        return "--app", flag, None
    if os.environ.get("INTERLOCK_APP"):
        return "INTERLOCK_APP", os.environ["INTERLOCK_APP"], None
    found = find_project(cwd)
    if found is not None and "app" in found[1]:
        pyproject, table = found
        return f"{pyproject} [tool.interlock] app", str(table["app"]), pyproject.parent
    return "the default", DEMO_REF, None


def find_project(cwd: Path | None = None) -> tuple[Path, dict[str, Any]] | None:
    """The ``pyproject.toml`` of ``cwd`` or of its nearest parent that has one, with its
    ``[tool.interlock]`` table (empty without one); None outside any project.

    Raises:
      AppRefError: that file is not valid TOML.
    """
    here = (cwd or Path.cwd()).resolve()
    for directory in (here, *here.parents):
        pyproject = directory / "pyproject.toml"
        if pyproject.is_file():
            try:
                with pyproject.open("rb") as file:
                    table = tomllib.load(file).get("tool", {}).get("interlock", {})
            except tomllib.TOMLDecodeError as exc:
                raise AppRefError(f"{pyproject}: not valid TOML ({exc}); fix it") from None
            return pyproject, table if isinstance(table, dict) else {}
    return None


def load_app(ref: str, where: str = "--app", base: Path | None = None) -> App:
    """Import the application ``ref`` names (``module:attribute`` or ``file.py:attribute``).

    The attribute may be an :class:`App`, a :class:`Machine` or a list of Machines. A
    relative file path is read from ``base`` (default: the current directory), and a
    module is imported from the current directory, then from ``base``.

    Raises:
      AppRefError: the reference is malformed, or names no module, file or attribute, or
        an object of another type (one line that says how to fix it).
    """
    value = _attribute(ref, where, base)
    if isinstance(value, App):
        return value
    if isinstance(value, Machine) or (
        isinstance(value, list | tuple) and value and all(isinstance(v, Machine) for v in value)
    ):
        return App(value)
    raise AppRefError(
        f"{where} {ref!r} is {_a(type(value).__name__)}, not an interlock App, Machine or "
        "list of Machines; point it at one"
    )


def _attribute(ref: str, where: str, base: Path | None) -> Any:
    target, _, attr = ref.rpartition(":")
    if not target or not attr.isidentifier():
        raise AppRefError(
            f"{where} {ref!r} must look like module:attribute or path/to/file.py:attribute"
        )
    if target.endswith(".py") or os.sep in target or "/" in target:
        module = _import_file((base or Path.cwd()) / Path(target).expanduser(), ref, where)
    else:
        path = [os.getcwd(), *([str(base)] if base is not None else [])]
        sys.path[:0] = path
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as exc:
            raise AppRefError(
                f"{where} {ref!r}: cannot import {target!r}: {exc}; run from the directory "
                f"that holds it, or name the file: path/to/{target.replace('.', '/')}.py:{attr}"
            ) from None
        except Exception as exc:
            raise _raised(ref, where, exc) from None
        finally:
            for entry in path:
                sys.path.remove(entry)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise AppRefError(
            f"{where} {ref!r}: {target!r} has no attribute {attr!r}; name its App, Machine "
            "or list of Machines"
        ) from None


def _import_file(path: Path, ref: str, where: str) -> Any:
    path = path.resolve()
    if not path.is_file():
        raise AppRefError(f"{where} {ref!r}: no file {str(path)!r}; give the path of a Python file")
    name = f"_interlock_app_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise AppRefError(f"{where} {ref!r}: {str(path)!r} is not a Python file; name a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.parent))  # so the file imports its siblings
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise _raised(ref, where, exc) from None
    finally:
        sys.path.remove(str(path.parent))
    return module


def _raised(ref: str, where: str, exc: Exception) -> AppRefError:
    return AppRefError(
        f"{where} {ref!r}: importing it raised {type(exc).__name__}: {exc}; fix the module"
    )
