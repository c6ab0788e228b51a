"""The layers hold: the import contracts (``.importlinter``) and no private names read
across packages.

The layout is core (pure) < stores | providers < runtime < gateway | client | testing < demo
< cli; docs/architecture says why. A private name (``_x``) is one module's business or its
package's: another package reaching for it is a knot the contracts cannot see, so this test
reads every module's source for it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import interlock

PACKAGE = Path(interlock.__file__).parent
ROOT = PACKAGE.parent.parent
CONFIG = ROOT / ".importlinter"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _owner(module: str) -> str:
    """The package a module belongs to for this rule: ``interlock.<pkg>``, or the module
    itself for a top-level module of its own (``interlock.protocol``)."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    base = PACKAGE.parent / rel
    return (
        base.with_suffix(".py").exists()
        or (base / "__init__.py").exists()
        or any(base.parent.glob(base.name + ".*.so"))
        or base.with_suffix(".pyi").exists()
    )


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private_reads() -> list[str]:
    """Every private name a module imports from another package, or reads as an attribute of
    a module it imported from another package, as ``importer: owner.name``."""
    found: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        tree = ast.parse(path.read_text(), str(path))
        foreign_modules: dict[str, str] = {}  # local name -> module of another package
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _resolve(module, path.name == "__init__.py", node)
                if not source.startswith("interlock"):
                    continue
                for alias in node.names:
                    target = f"{source}.{alias.name}"
                    local = alias.asname or alias.name
                    if _is_module(target):
                        if _owner(target) != _owner(module):
                            foreign_modules[local] = target
                        continue
                    if (
                        alias.name.startswith("_")
                        and not alias.name.startswith("__")
                        and _owner(source) != _owner(module)
                    ):
                        found.append(f"{module}: {source}.{alias.name}")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in foreign_modules
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                found.append(f"{module}: {foreign_modules[node.value.id]}.{node.attr}")
    return sorted(set(found))


def test_the_import_contracts_hold() -> None:
    importlinter_cli = pytest.importorskip("importlinter.cli", reason="pip install import-linter")
    assert importlinter_cli.lint_imports(config_filename=str(CONFIG)) == 0, (
        "an import contract is broken: run `lint-imports` for the chain of imports"
    )


def test_the_contracts_ignore_only_imports_of_the_compiled_modules() -> None:
    # grimp cannot see a compiled module, and records an import of one as an import of the
    # root package. Each ignored line must be exactly such an import, or it hides a real one.
    ignored = re.findall(
        r"^\s+(interlock[\w.]*) -> (interlock[\w.]*)\s*$", CONFIG.read_text(), re.M
    )
    assert ignored
    for importer, imported in ignored:
        assert imported == "interlock", f"{importer} -> {imported} is a real import"
        source = (PACKAGE.parent / Path(*importer.split("."))).with_suffix(".py").read_text()
        imports = re.findall(r"^\s*from (\.+[\w.]*) import", source, re.M)
        compiled = [i for i in imports if i.rsplit(".", 1)[-1] in ("_hot", "_decide")]
        assert compiled, f"{importer} imports no compiled module: drop its ignore line"
        assert not re.search(r"^\s*(from interlock import|import interlock\b)", source, re.M)


#: Private names one package still reads of another, each a known knot with the issue that
#: unties it. The list only shrinks: a new entry is a new knot.
ALLOWED: frozenset[str] = frozenset(
    line.strip()
    for line in (Path(__file__).parent / "data" / "private_names_allowlist.txt")
    .read_text()
    .splitlines()
    if line.strip() and not line.startswith("#")
)


def test_no_package_reads_another_packages_private_names() -> None:
    reads = set(private_reads())
    new = sorted(reads - ALLOWED)
    assert not new, "private names read across packages (make them public or move them):\n" + (
        "\n".join(new)
    )
    gone = sorted(ALLOWED - reads)
    assert not gone, "no longer read, drop from the allowlist:\n" + "\n".join(gone)


def test_the_private_reads_scan_finds_a_planted_read(tmp_path: Path) -> None:
    # The scan itself can fail: a module reading another package's private name is found.
    planted = PACKAGE / "gateway" / "_planted_for_test.py"
    planted.write_text(
        "from ..runtime._supervisor import _ClosedRun\nfrom ..core import _view\nx = _view._fold\n"
    )
    try:
        reads = private_reads()
    finally:
        planted.unlink()
    assert "interlock.gateway._planted_for_test: interlock.runtime._supervisor._ClosedRun" in reads
    assert "interlock.gateway._planted_for_test: interlock.core._view._fold" in reads


#: The names a supervisor goes by in a driver's code: ``supervisor``, ``sup``, and the
#: ``.supervisor`` of anything (``self.supervisor``, ``service.supervisor``).
SUPERVISOR_NAMES = frozenset({"supervisor", "sup"})


def _is_supervisor(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in SUPERVISOR_NAMES
    return isinstance(node, ast.Attribute) and node.attr == "supervisor"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def supervisor_private_reads(root: Path) -> list[str]:
    """Every read or write of a supervisor's private member (``supervisor._runs``,
    ``self.supervisor._actors``, ``getattr(sup, "_runs")``) in the modules under
    ``root``, as ``path:line: what``."""
    found: list[tuple[str, int, str]] = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                target = node.value
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "delattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and _private(node.args[1].value)
            ):
                target = node.args[0]
            else:
                continue
            if _is_supervisor(target):
                found.append((str(path.relative_to(root.parent)), node.lineno, ast.unparse(node)))
    return [f"{path}:{line}: {what}" for path, line, what in sorted(found)]


def test_the_gateway_reaches_the_supervisor_only_through_public_names() -> None:
    # The gateway is a driver: it starts, drives, settles and looks up runs through the
    # supervisor's port (Supervisor.external) and its other public names, so the runtime
    # may change its own state without breaking a driver (and the next drivers, a proxy,
    # have one contract to follow).
    reads = supervisor_private_reads(PACKAGE / "gateway")
    assert not reads, "the gateway reads the supervisor's private state (use its port):\n" + (
        "\n".join(reads)
    )


def test_the_supervisor_scan_finds_a_planted_read(tmp_path: Path) -> None:
    # The scan itself can fail: every way of reaching a supervisor's private member.
    driver = tmp_path / "driver"
    driver.mkdir()
    (driver / "_planted.py").write_text(
        "def f(supervisor, sup, self, service):\n"
        "    a = supervisor._runs\n"
        "    b = self.supervisor._journal.closed\n"
        "    sup._runs['x'] = 1\n"
        "    del service.supervisor._lost['x']\n"
        "    e = getattr(sup, '_actors')\n"
        "    ok = supervisor.external.get, self.supervisor.__class__, self._answers\n"
    )
    assert supervisor_private_reads(driver) == [
        "driver/_planted.py:2: supervisor._runs",
        "driver/_planted.py:3: self.supervisor._journal",
        "driver/_planted.py:4: sup._runs",
        "driver/_planted.py:5: service.supervisor._lost",
        "driver/_planted.py:6: getattr(sup, '_actors')",
    ]
