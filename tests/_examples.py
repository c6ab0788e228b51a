"""The examples of a documentation page: read them (``parse``) and run them (``main``).

The convention every page is written to (CONTRIBUTING.md says it for writers):

- Every ```` ```python ```` block runs. The blocks of one page run in order in one
  namespace, in a fresh temporary working directory, under a timeout. A block may
  ``await`` (and ``async with``) at its top level, as in ``python -m trio``'s REPL: it then
  runs under ``trio.run``, one call per block.
- ``<!-- example: skip REASON -->`` just before a block: it does not run. REASON is
  required (only for what needs an outside service CI does not have).
- ``<!-- example: file NAME -->``: the block is not run but written to NAME in the page's
  temporary directory, for a later block (``import shop``) or command (``--app shop.py:app``).
- ```` ```console ```` blocks run only after ``<!-- example: run -->``: each line starting
  with ``$ `` is a command run with bash in the page's directory (``interlock`` on PATH),
  and must exit 0. After ``<!-- example: run, output -->`` the lines after a command must
  appear in its output, in order (a ``...`` line skips any number of lines, ``...`` in a
  line any text).

"Just before" means the marker is the last non-blank line before the block's fence.

``python tests/_examples.py SPEC.json`` runs the steps ``steps_of`` made of a page (this
is what the tests start, one process per page, in the page's temporary directory) and
exits 1 naming the page and line of the first that fails.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*?)[ \t]*$")
MARKER = re.compile(r"^[ \t]*<!--[ \t]*example:(?P<body>.*?)-->[ \t]*$")
PYTHON = frozenset({"python", "py", "python3"})
CONSOLE = frozenset({"console"})
#: Seconds a page's examples may take, all of them.
PAGE_TIMEOUT = 120.0


class ExampleError(Exception):
    """A page breaks the convention (a marker without its block, a skip without a reason)."""


@dataclass(frozen=True)
class Block:
    """A fenced block of a page: its language, its first line's number and its text."""

    language: str
    line: int
    code: str
    marker: str | None
    marker_line: int


def blocks_of(text: str) -> list[Block]:
    """Every fenced block of ``text`` with the marker just before it, if any."""
    lines = text.splitlines()
    blocks: list[Block] = []
    marker: tuple[str, int] | None = None
    index = 0
    while index < len(lines):
        line = lines[index]
        found = MARKER.match(line)
        if found is not None:
            if marker is not None:
                raise ExampleError(f"line {marker[1]}: an example marker without its block")
            marker = (found["body"].strip(), index + 1)
            index += 1
            continue
        fence = FENCE.match(line)
        if fence is None:
            if line.strip() and marker is not None:
                raise ExampleError(
                    f"line {marker[1]}: an example marker must be just before its block "
                    "(nothing but blank lines between them)"
                )
            index += 1
            continue
        indent, mark = fence["indent"], fence["fence"]
        info = fence["info"].strip().lstrip("{").lstrip(".")
        language = info.split()[0].lower() if info else ""
        body: list[str] = []
        index += 1
        while index < len(lines):
            closing = lines[index].strip()
            if closing.startswith(mark[0] * len(mark)) and not closing.strip(mark[0]):
                break
            text_line = lines[index]
            body.append(text_line[len(indent) :] if text_line.startswith(indent) else text_line)
            index += 1
        else:
            raise ExampleError(f"line {index}: a code block that is never closed")
        blocks.append(
            Block(
                language,
                index - len(body) + 1,
                "\n".join(body) + "\n",
                marker[0] if marker else None,
                marker[1] if marker else 0,
            )
        )
        marker = None
        index += 1
    if marker is not None:
        raise ExampleError(f"line {marker[1]}: an example marker without its block")
    return blocks


def steps_of(text: str) -> list[dict[str, Any]]:
    """What to run of a page, in order: python blocks, files to write, console commands.

    Raises:
      ExampleError: if a marker is unknown, misplaced, or a skip has no reason.
    """
    steps: list[dict[str, Any]] = []
    for block in blocks_of(text):
        where = f"line {block.marker_line}"
        marker = block.marker
        if marker is None:
            if block.language in PYTHON:
                steps.append({"kind": "python", "line": block.line, "code": block.code})
            continue
        word, _, rest = marker.partition(" ")
        rest = rest.strip()
        if word == "skip":
            if not rest:
                raise ExampleError(f"{where}: 'example: skip' needs a reason")
        elif word == "file":
            if not rest or Path(rest).is_absolute() or ".." in Path(rest).parts:
                raise ExampleError(
                    f"{where}: 'example: file NAME' needs a relative NAME, got {rest!r}"
                )
            steps.append({"kind": "file", "line": block.line, "name": rest, "code": block.code})
        elif marker.replace(" ", "") in ("run", "run,output"):
            if block.language not in CONSOLE:
                raise ExampleError(
                    f"{where}: 'example: {marker}' is for a console block, not {block.language!r}"
                )
            steps.append(
                {
                    "kind": "console",
                    "line": block.line,
                    "code": block.code,
                    "output": marker.replace(" ", "") == "run,output",
                }
            )
        else:
            raise ExampleError(
                f"{where}: unknown marker 'example: {marker}'; "
                "use skip REASON, file NAME, run or run, output"
            )
    return steps


def commands_of(code: str, first_line: int) -> list[tuple[int, str, list[str]]]:
    """The ``$ `` commands of a console block: ``(line, command, expected output lines)``."""
    commands: list[tuple[int, str, list[str]]] = []
    lines = code.splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        if not line.startswith("$ "):
            if commands:
                commands[-1][2].append(line.rstrip())
            index += 1
            continue
        number = first_line + index
        command = line[2:]
        while command.endswith("\\") and index + 1 < len(lines):
            index += 1
            command = command[:-1] + "\n" + lines[index]
        commands.append((number, command, []))
        index += 1
    return commands


def output_matches(expected: list[str], output: str) -> bool:
    """Whether the expected lines appear in ``output`` in order; ``...`` skips lines.

    Between two ``...`` lines (or the block's ends) the lines must follow one another;
    ``...`` within a line matches any text.
    """
    while expected and not expected[-1].strip():
        expected = expected[:-1]
    got = [line.rstrip() for line in output.splitlines()]
    segments: list[list[str]] = [[]]
    for line in (line.rstrip() for line in expected):
        if line.strip() == "...":
            segments.append([])
        else:
            segments[-1].append(line)
    position = 0
    for segment in segments:
        if not segment:
            continue
        patterns = [_line_pattern(line) for line in segment]
        for start in range(position, len(got) - len(segment) + 1):
            window = got[start : start + len(segment)]
            if all(p.fullmatch(line) for p, line in zip(patterns, window, strict=True)):
                position = start + len(segment)
                break
        else:
            return False
    return True


def _line_pattern(line: str) -> re.Pattern[str]:
    """An expected line: ``...`` inside it stands for any text (run ids, times)."""
    return re.compile(".*".join(re.escape(part) for part in line.split("...")))


def _run_console(page: str, step: dict[str, Any]) -> str | None:
    for line, command, expected in commands_of(step["code"], step["line"]):
        try:
            done = subprocess.run(
                ["bash", "-c", command],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=PAGE_TIMEOUT,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return f"{page}:{line}: `{command}` did not finish in {PAGE_TIMEOUT:g} s"
        if done.returncode != 0:
            return f"{page}:{line}: `{command}` exited {done.returncode}:\n{done.stdout}"
        if step["output"] and not output_matches(expected, done.stdout):
            return (
                f"{page}:{line}: `{command}` did not print what the page says.\n"
                "expected:\n" + "\n".join(expected) + "\ngot:\n" + done.stdout
            )
    return None


async def _awaited(coroutine: Any) -> None:
    await coroutine


def main(argv: list[str]) -> int:
    """Run the steps in ``argv[0]`` (JSON: ``page``, ``path``, ``steps``) in the cwd."""
    spec = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    page, path = spec["page"], spec["path"]
    # the page's directory, not tests/, is where its modules are imported from
    sys.path[0] = os.getcwd()
    namespace: dict[str, Any] = {"__name__": "__main__"}
    for step in spec["steps"]:
        if step["kind"] == "file":
            target = Path(step["name"])
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(step["code"], encoding="utf-8")
        elif step["kind"] == "python":
            # padded so that a traceback names the page's own line numbers
            source = "\n" * (step["line"] - 1) + step["code"]
            try:
                code = compile(source, path, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
                if code.co_flags & inspect.CO_COROUTINE:
                    # top-level await, as in `python -m trio`'s REPL: run it under trio
                    import trio

                    trio.run(_awaited, eval(code, namespace))
                else:
                    exec(code, namespace)
            except BaseException:
                traceback.print_exc()
                print(f"{page}:{step['line']}: this python block failed", file=sys.stderr)
                return 1
        else:
            failure = _run_console(page, step)
            if failure is not None:
                print(failure, file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
