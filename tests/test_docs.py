"""The documentation: the site builds with ``mkdocs build --strict``, and every example runs.

One test per page (README.md and docs/**/*.md) runs the page's examples by the convention
in ``tests/_examples.py`` (CONTRIBUTING.md says it for writers), in a process of its own
in a fresh temporary directory, with the fake LLM server (``python -m interlock.testing``)
started once for the session: its base URLs are in ``INTERLOCK_EXAMPLE_OPENAI_URL`` and
``INTERLOCK_EXAMPLE_ANTHROPIC_URL``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._examples import PAGE_TIMEOUT, ExampleError, output_matches, steps_of

ROOT = Path(__file__).resolve().parents[1]
RUNNER = Path(__file__).resolve().parent / "_examples.py"
PAGES = sorted(
    [ROOT / "README.md"]
    + [p for p in (ROOT / "docs").rglob("*.md") if "_hooks" not in p.relative_to(ROOT).parts]
)


def _environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of what the tests start: this checkout's interlock first."""
    env = dict(os.environ)
    env.pop("INTERLOCK_APP", None)  # an example names its application itself
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra or {})
    return env


@pytest.fixture(scope="session")
def fake_llm() -> Iterator[dict[str, str]]:
    """The fake LLM, once for the session: the variables that give its base URLs."""
    process = subprocess.Popen(
        [sys.executable, "-m", "interlock.testing"],
        stdout=subprocess.PIPE,
        text=True,
        env=_environment(),
    )
    try:
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], 60)
        assert ready, "the fake LLM printed no URL in 60 s"
        url = process.stdout.readline().strip()
        assert url.startswith("http://"), f"the fake LLM printed {url!r}, not its URL"
        yield {
            "INTERLOCK_EXAMPLE_OPENAI_URL": url + "/v1",
            "INTERLOCK_EXAMPLE_ANTHROPIC_URL": url,
        }
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


@pytest.fixture(scope="session")
def interlock_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with an ``interlock`` command that runs this checkout's interlock."""
    directory = tmp_path_factory.mktemp("bin")
    script = directory / "interlock"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m interlock "$@"\n')
    script.chmod(0o755)
    return directory


def run_page(
    path: Path, directory: Path, env: dict[str, str], page: str | None = None
) -> subprocess.CompletedProcess[str] | None:
    """Run ``path``'s examples in ``directory``; None if it has nothing to run.

    Raises:
      ExampleError: the page breaks the example convention.
      subprocess.TimeoutExpired: its examples took more than ``PAGE_TIMEOUT`` seconds.
    """
    page = page or path.relative_to(ROOT).as_posix()
    steps = steps_of(path.read_text(encoding="utf-8"))
    if not steps:
        return None
    spec = directory.parent / f"{directory.name}.json"
    spec.write_text(json.dumps({"page": page, "path": str(path), "steps": steps}))
    # its own process group: a timeout ends what its commands started too
    process = subprocess.Popen(
        [sys.executable, str(RUNNER), str(spec)],
        cwd=directory,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=PAGE_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # a server an example left running
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.fixture
def page_env(fake_llm: dict[str, str], interlock_bin: Path) -> dict[str, str]:
    return _environment(
        {**fake_llm, "PATH": f"{interlock_bin}{os.pathsep}{os.environ.get('PATH', '')}"}
    )


@pytest.mark.parametrize("path", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_examples_run(path: Path, tmp_path: Path, page_env: dict[str, str]) -> None:
    directory = tmp_path / "page"
    directory.mkdir()
    page = path.relative_to(ROOT).as_posix()
    try:
        done = run_page(path, directory, page_env)
    except ExampleError as exc:
        pytest.fail(f"{page}: {exc}", pytrace=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{page}: its examples did not finish in {PAGE_TIMEOUT:g} s", pytrace=False)
    if done is not None and done.returncode != 0:
        pytest.fail(done.stdout + done.stderr, pytrace=False)


def test_site_builds_strict(tmp_path: Path) -> None:
    """``mkdocs build --strict``: no broken link, no docstring griffe cannot read; offline."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(tmp_path / "site"),
        ],
        cwd=ROOT,
        env=_environment({"NO_MKDOCS_2_WARNING": "1"}),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for page in ("reference/cli", "reference/http", "reference/events", "performance", "changelog"):
        html = (tmp_path / "site" / page / "index.html").read_text(encoding="utf-8")
        assert "<!-- generated:" not in html, page
    assert "interlock worker" in (tmp_path / "site/reference/cli/index.html").read_text()


# -- the collector itself -------------------------------------------------------------------


def test_a_failing_block_fails_its_page_naming_the_line(tmp_path: Path) -> None:
    page = tmp_path / "broken.md"
    page.write_text(
        "# Broken\n\n```python\nx = 1\n```\n\nText.\n\n```python\nassert x == 2, 'x is 1'\n```\n"
    )
    directory = tmp_path / "page"
    directory.mkdir()
    done = run_page(page, directory, _environment(), page="broken.md")
    assert done is not None
    assert done.returncode == 1
    assert "broken.md:10: this python block failed" in done.stderr
    assert f'File "{page}", line 10' in done.stderr
    assert "AssertionError: x is 1" in done.stderr


def test_file_run_and_output_markers(tmp_path: Path, interlock_bin: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- example: file shop.py -->\n```python\nNAME = 'shop'\n```\n\n"
        "<!-- example: file lib/never.py -->\n```python\nraise SystemExit(3)\n```\n\n"
        "```python\nimport shop\nassert shop.NAME == 'shop'\n```\n\n"
        "<!-- example: skip needs a paid API key -->\n```python\nraise RuntimeError\n```\n\n"
        "```console\n$ false\n```\n\n"
        "<!-- example: run, output -->\n```console\n$ echo one; echo two; echo three\none\n"
        "...\nthree\n$ ls\nlib\nshop.py\n$ interlock --help\nusage: interlock [-h]...\n...\n```\n"
    )
    directory = tmp_path / "page"
    directory.mkdir()
    env = _environment({"PATH": f"{interlock_bin}{os.pathsep}{os.environ['PATH']}"})
    done = run_page(page, directory, env, page="page.md")
    assert done is not None
    assert done.returncode == 0, done.stderr
    assert (directory / "shop.py").read_text() == "NAME = 'shop'\n"
    assert (directory / "lib/never.py").read_text() == "raise SystemExit(3)\n"


def test_a_command_whose_output_differs_fails(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- example: run, output -->\n```console\n$ echo two\none\n```\n")
    directory = tmp_path / "page"
    directory.mkdir()
    done = run_page(page, directory, _environment(), page="page.md")
    assert done is not None
    assert done.returncode == 1
    assert "page.md:3: `echo two` did not print what the page says" in done.stderr


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "<!-- example: skip -->\n```python\npass\n```\n",
            "line 1: 'example: skip' needs a reason",
        ),
        (
            "<!-- example: skip   -->\n```python\npass\n```\n",
            "line 1: 'example: skip' needs a reason",
        ),
        (
            "<!-- example: run -->\n```python\npass\n```\n",
            "line 1: 'example: run' is for a console block, not 'python'",
        ),
        (
            "<!-- example: file ../x.py -->\n```python\npass\n```\n",
            "line 1: 'example: file NAME' needs a relative NAME, got '../x.py'",
        ),
        (
            "<!-- example: skp no key -->\n```python\npass\n```\n",
            "line 1: unknown marker 'example: skp no key'; use skip REASON, file NAME, run or "
            "run, output",
        ),
        (
            "<!-- example: skip a reason -->\nSome text.\n```python\npass\n```\n",
            "line 1: an example marker must be just before its block",
        ),
        ("Text.\n<!-- example: run -->\n", "line 2: an example marker without its block"),
    ],
)
def test_a_misused_marker_is_an_error(text: str, message: str) -> None:
    with pytest.raises(ExampleError) as caught:
        steps_of(text)
    assert str(caught.value).startswith(message)


def test_blocks_keep_their_page_line_and_indentation() -> None:
    steps = steps_of("# T\n\n1. Item:\n\n    ```python\n    x = 1\n    ```\n")
    assert steps == [{"kind": "python", "line": 6, "code": "x = 1\n"}]


@pytest.mark.parametrize(
    ("expected", "output", "matches"),
    [
        (["a", "b"], "a\nb\n", True),
        (["a", "b"], "a\nx\nb\n", False),
        (["a", "...", "b"], "a\nx\nb\n", True),
        (["b", "a"], "a\nb\n", False),
        (["a  "], "a\n", True),
        (["run ... completed"], "run r-1f3 completed\n", True),
        (["run ... completed"], "run r-1f3 failed\n", False),
    ],
)
def test_output_matching(expected: list[str], output: str, matches: bool) -> None:
    assert output_matches(expected, output) is matches


def test_a_block_may_await_at_top_level(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nimport trio\n\nasync with trio.open_nursery() as nursery:\n"
        "    nursery.start_soon(trio.sleep, 0)\nslept = await trio.sleep(0)\n```\n\n"
        "```python\nassert slept is None\n```\n"
    )
    directory = tmp_path / "page"
    directory.mkdir()
    done = run_page(page, directory, _environment(), page="page.md")
    assert done is not None
    assert done.returncode == 0, done.stderr


def test_a_page_that_hangs_is_cut(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page = tmp_path / "page.md"
    page.write_text("```python\nimport time\ntime.sleep(60)\n```\n")
    directory = tmp_path / "page"
    directory.mkdir()
    monkeypatch.setattr(sys.modules[__name__], "PAGE_TIMEOUT", 1.0)
    with pytest.raises(subprocess.TimeoutExpired):
        run_page(page, directory, _environment(), page="page.md")


def _hook() -> Any:
    spec = importlib.util.spec_from_file_location(
        "interlock_docs_hook", ROOT / "docs" / "_hooks" / "generate.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["36.perff.md", "36.bugfix.a1.md", "notes.md", "36.md"])
def test_a_fragment_towncrier_would_drop_fails_the_build(tmp_path: Path, name: str) -> None:
    from mkdocs.exceptions import PluginError

    hook = _hook()
    (tmp_path / "36.perf.md").write_text("Faster.\n")
    (tmp_path / name).write_text("Dropped.\n")
    hook.CHANGES = tmp_path
    with pytest.raises(PluginError, match=rf"^changes/{re.escape(name)}: a fragment is named"):
        hook.check_fragments()


def test_every_fragment_type_in_changes_is_configured() -> None:
    """towncrier drops a fragment of a type it is not configured for (it dropped `perf`)."""
    hook = _hook()
    fragments = hook.check_fragments()
    assert len(fragments) == len(list((ROOT / "changes").glob("*.md")))
    configured = [directory for directory, _ in hook._fragment_types()]
    assert {kind for _, kind, _ in fragments} <= set(configured)
    assert {"breaking", "feature", "bugfix", "perf", "doc", "misc"} <= set(configured)
