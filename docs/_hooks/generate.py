"""MkDocs hook: generate the pages that must not go stale, at every build.

A page that is generated keeps its hand-written introduction and holds a marker where the
generated part goes, ``<!-- generated: NAME -->`` on a line of its own:

- ``cli``: the command line, from the argument parser (``interlock.cli._parser``);
- ``http``: the gateway's HTTP API, from its OpenAPI document
  (``interlock.gateway.openapi_document``);
- ``events``: the journal's event types, from ``interlock.events``;
- ``performance``: the goals and figures of ``benchmarks/results.json``, rendered by the
  benchmark suite's own functions (the ones that write ``benchmarks/RESULTS.md``);
- ``changelog``: the fragments in ``changes/``, through ``towncrier build --draft``.

A page listed in :data:`PAGES` without its marker, an unknown marker, or a fragment whose
type towncrier is not configured for fails the build: nothing here may drop content
without a word.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tomllib
import typing
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

if typing.TYPE_CHECKING:
    from collections.abc import Callable

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
CHANGES = ROOT / "changes"
MARKER = re.compile(r"^<!-- generated: ([a-z]+) -->$", re.MULTILINE)

#: The charts of the benchmark suite, served beside the performance page.
CHARTS_URI = "assets/benchmarks"


def _import_paths() -> None:
    # The hook imports this tree's interlock (src/) and the benchmark suite (the root).
    for path in (str(ROOT / "src"), str(ROOT)):
        if path not in sys.path:
            sys.path.insert(0, path)


def _cell(text: object) -> str:
    """Text for a Markdown table cell: one line, pipes escaped outside code spans.

    Python-Markdown's tables ignore a pipe inside backticks, and show a backslash there.
    """
    parts = re.split(r"(`[^`]*`)", " ".join(str(text).split()))
    return "".join(p if i % 2 else p.replace("|", "\\|") for i, p in enumerate(parts))


def _table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# -- the command line ----------------------------------------------------------------------


def cli_markdown() -> str:
    """Every command of ``interlock``, its usage and its arguments, from the parser."""
    _import_paths()
    from interlock.cli._parser import build_parser

    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "90"  # the usage lines wrap here, whatever the terminal
    try:
        parser = build_parser()
        parts: list[str] = []
        _cli_parser(parser, "interlock", parts, help_text=parser.description or "")
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    return "\n".join(parts)


def _cli_parser(
    parser: argparse.ArgumentParser, name: str, parts: list[str], help_text: str
) -> None:
    level = "#" * min(2 + name.count(" "), 4)
    parts += [f"{level} `{name}`", ""]
    if help_text:
        sentence = help_text[0].upper() + help_text[1:]
        parts += [sentence if sentence.endswith(".") else sentence + ".", ""]
    usage = parser.format_usage().strip().removeprefix("usage: ")
    parts += ["```text", usage, "```", ""]
    formatter = parser._get_formatter()
    rows = []
    children: list[tuple[str, argparse.ArgumentParser, str]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for child, subparser in action.choices.items():
                children.append((child, subparser, helps.get(child, "")))
                rows.append([f"`{child}`", helps.get(child, "")])
            continue
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue  # every command has -h, --help: the page says so once
        if action.option_strings:
            flags = ", ".join(action.option_strings)
            if action.nargs != 0:
                flags += " " + formatter._format_args(action, action.dest.upper())
        else:
            flags = formatter._format_args(action, action.dest)
        described = formatter._expand_help(action) if action.help else ""
        if action.choices is not None and action.metavar is not None:
            # a metavar hides the choices that the flags would otherwise list
            described += (
                (" " if described else "")
                + "One of: "
                + ", ".join(f"`{choice}`" for choice in action.choices)
            )
        rows.append([f"`{flags}`", described])
    if rows:
        parts += [_table(["argument", "what it does"], rows), ""]
    for child, subparser, child_help in children:
        _cli_parser(subparser, f"{name} {child}", parts, child_help)


# -- the HTTP API ---------------------------------------------------------------------------


def http_markdown() -> str:
    """Every route of the gateway and every body it reads or writes, from its OpenAPI."""
    _import_paths()
    from interlock.gateway import openapi_document

    document = openapi_document()
    schemas: dict[str, Any] = document["components"]["schemas"]
    parts = [
        f"The OpenAPI {document['openapi']} document of *{document['info']['title']}* "
        f"{document['info']['version']}; a running gateway serves the same document at "
        "`GET /openapi.json`.",
        "",
        "## Routes",
        "",
        _table(
            ["method", "path", "what it does"],
            [
                [
                    f"`{method.upper()}`",
                    f"[`{path}`](#{_route_anchor(method, path)})",
                    op["summary"],
                ]
                for path, item in document["paths"].items()
                for method, op in item.items()
            ],
        ),
        "",
    ]
    for path, item in document["paths"].items():
        for method, operation in item.items():
            parts += _http_operation(method, path, operation)
    parts += ["## Bodies", ""]
    for name, schema in schemas.items():
        parts += _http_schema(name, schema)
    return "\n".join(parts)


def _route_anchor(method: str, path: str) -> str:
    return f"{method}-" + re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-")


def _http_operation(method: str, path: str, operation: dict[str, Any]) -> list[str]:
    parts = [
        f"### `{method.upper()} {path}` {{ #{_route_anchor(method, path)} }}",
        "",
        operation["summary"] + ".",
        "",
    ]
    if operation.get("description"):
        parts += [operation["description"], ""]
    if operation.get("parameters"):
        parts += [
            _table(
                ["parameter", "in", "type", "what it is"],
                [
                    [
                        f"`{p['name']}`" + ("" if p.get("required") else " (optional)"),
                        p["in"],
                        _schema_type(p.get("schema", {})),
                        p.get("description", ""),
                    ]
                    for p in operation["parameters"]
                ],
            ),
            "",
        ]
    body = operation.get("requestBody")
    if body:
        parts += [
            "Request body: " + _content(body.get("content", {})) + ".",
            "",
        ]
    parts += [
        _table(
            ["status", "meaning", "body"],
            [
                [
                    f"`{status}`",
                    response.get("description", ""),
                    _content(response.get("content", {})),
                ]
                for status, response in sorted(operation["responses"].items())
            ],
        ),
        "",
    ]
    return parts


def _content(content: dict[str, Any]) -> str:
    by_schema: dict[str, list[str]] = {}
    for media, entry in content.items():
        by_schema.setdefault(_schema_type(entry.get("schema", {})), []).append(f"`{media}`")
    return (
        "; ".join(f"{kind} as {' or '.join(media)}" for kind, media in by_schema.items()) or "none"
    )


def _schema_type(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    if "anyOf" in schema or "oneOf" in schema:
        return " or ".join(_schema_type(s) for s in schema.get("anyOf", schema.get("oneOf")))
    if "enum" in schema:
        return " or ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    kind = schema.get("type", "any")
    if isinstance(kind, list):
        return " or ".join(kind)
    if kind == "array":
        return "array of " + _schema_type(schema.get("items", {}))
    if kind == "object" and "additionalProperties" in schema:
        values = schema["additionalProperties"]
        if isinstance(values, dict):
            return "object of " + _schema_type(values)
    return kind


def _http_schema(name: str, schema: dict[str, Any]) -> list[str]:
    parts = [f"### {name}", ""]
    if schema.get("description"):
        parts += [schema["description"], ""]
    properties = schema.get("properties")
    if properties:
        required = set(schema.get("required", ()))
        rows = []
        for field, spec in properties.items():
            notes = [spec.get("description", "")]
            for variant in spec.get("anyOf", ()):
                notes.append(variant.get("description", ""))
            if field not in required and "default" in spec:
                notes.append(f"default `{json.dumps(spec['default'])}`")
            rows.append(
                [
                    f"`{field}`" + ("" if field in required else " (optional)"),
                    _schema_type(spec),
                    "; ".join(n for n in notes if n),
                ]
            )
        parts += [_table(["field", "type", "notes"], rows), ""]
    elif schema.get("type"):
        parts += [f"Type: {_schema_type(schema)}.", ""]
    return parts


# -- the journal's events -------------------------------------------------------------------


def events_markdown() -> str:
    """One row per event type: its ``kind``, its class and its fields."""
    _import_paths()
    import msgspec

    from interlock import events

    rows = []
    for cls in typing.get_args(events.JournalEvent):
        tag = cls.__struct_config__.tag
        hints = typing.get_type_hints(cls)
        own = [f.name for f in msgspec.structs.fields(cls) if f.name not in ("run_id", "seq", "ts")]
        fields = ", ".join(f"`{name}: {_type_name(hints[name])}`" for name in own)
        summary = (cls.__doc__ or "").strip().split("\n\n")[0]
        rows.append(
            [f"`{tag}`", f"[`{cls.__name__}`][interlock.events.{cls.__name__}]", fields, summary]
        )
    return _table(["kind", "class", "fields", "what it records"], rows)


def _type_name(hint: Any) -> str:
    import msgspec

    if hint is msgspec.UnsetType:
        return "absent"
    if hint is type(None):
        return "None"
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            return f"tuple[{_type_name(args[0])}, ...]"
        return f"{name}[{', '.join(_type_name(a) for a in args)}]"
    if hint is Any:
        return "Any"
    return getattr(hint, "__name__", str(hint))


# -- performance ----------------------------------------------------------------------------


def performance_markdown() -> str:
    """The goals and every section of ``benchmarks/results.json``, as RESULTS.md has them."""
    _import_paths()
    from benchmarks import load
    from benchmarks.__main__ import CHARTS, goals_markdown
    from benchmarks._report import environment_markdown

    recorded = json.loads((BENCHMARKS / "results.json").read_text(encoding="utf-8"))
    meta, results, goals = recorded["meta"], recorded["benchmarks"], recorded["goals"]
    met = sum(1 for goal in goals if goal["met"])
    parts = [
        "## The run these figures come from",
        "",
        environment_markdown(meta["environment"], meta["command"], meta["date"], meta["seconds"]),
        "",
        "## Goals",
        "",
        f"{met} of {len(goals)} goals met.",
        "",
        _demote(goals_markdown(goals)),
    ]
    for name in meta["benchmarks"]:
        module = load(name)
        result = results[name]
        parts += ["", f"## {module.TITLE}", ""]
        doc = (module.__doc__ or "").strip().split("\n\n")[0]
        if doc:
            parts += [
                f"*What is measured (`benchmarks/bench_{name}.py`):* {' '.join(doc.split())}",
                "",
            ]
        if "error" in result:
            parts += [f"**Failed in this run:** `{result['error']}`"]
            continue
        merged = result.get("merged")
        if merged:
            env = merged["environment"]
            parts += [
                f"*Run on its own, after the rest: `{merged['command']}` on {merged['date']}, "
                f"checkout {env['git'].get('commit') or 'unknown'}"
                + (" with uncommitted changes" if env["git"].get("dirty") else "")
                + f", on {env['cpu']} ({env['cores']} cores): compare its ratios within it.*",
                "",
            ]
        parts.append(_demote(module.render(result)))
        if name in CHARTS and (BENCHMARKS / CHARTS[name][0]).exists():
            parts += ["", f"![{CHARTS[name][1]}]({CHARTS_URI}/{CHARTS[name][0]})"]
    return _blank_before_lists("\n".join(parts))


LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+\.) ")


def _blank_before_lists(markdown: str) -> str:
    """A blank line before each list that follows a paragraph line.

    RESULTS.md is read on GitHub, where a list may follow a paragraph directly; in
    Python-Markdown the list would be read as more of the paragraph.
    """
    out: list[str] = []
    fenced = False
    for line in markdown.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        previous = out[-1] if out else ""
        if (
            not fenced
            and LIST_ITEM.match(line)
            and previous.strip()
            and not LIST_ITEM.match(previous)
            and not previous.startswith((" ", "\t", "|"))
        ):
            out.append("")
        out.append(line)
    return "\n".join(out)


def _demote(markdown: str) -> str:
    """Headings of a rendered section one level down, under the page's own ``##``."""
    return re.sub(r"^(#{1,5}) ", lambda m: "#" + m.group(1) + " ", markdown, flags=re.MULTILINE)


# -- the changelog --------------------------------------------------------------------------


def _fragment_types() -> list[tuple[str, str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return [(t["directory"], t["name"]) for t in config["tool"]["towncrier"]["type"]]


def check_fragments() -> list[tuple[str, str, str]]:
    """Every fragment in ``changes/`` as ``(issue, type, text)``; refuse what towncrier drops.

    towncrier skips a file whose type it is not configured for, and takes a counter that
    is not a number for a second fragment of the same issue and type.
    """
    types = [directory for directory, _ in _fragment_types()]
    pattern = re.compile(rf"^(\d+)\.({'|'.join(map(re.escape, types))})(?:\.\d+)?\.md$")
    fragments = []
    for path in sorted(CHANGES.iterdir()):
        if path.name.startswith("."):
            continue
        match = pattern.match(path.name)
        if match is None:
            raise PluginError(
                f"changes/{path.name}: a fragment is named ISSUE.TYPE.md or ISSUE.TYPE.N.md "
                f"(N a number), TYPE one of {', '.join(types)} "
                "([tool.towncrier.type] in pyproject.toml)"
            )
        fragments.append((match[1], match[2], path.read_text(encoding="utf-8").strip()))
    return fragments


def changelog_markdown() -> str:
    """The unreleased changes: ``towncrier build --draft`` of ``changes/``."""
    fragments = check_fragments()
    if not fragments:
        return "No unreleased changes."
    try:
        import towncrier  # noqa: F401
    except ImportError:
        rendered = _render_fragments(fragments)
    else:
        done = subprocess.run(
            [sys.executable, "-m", "towncrier", "build", "--draft", "--version", "Unreleased"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise PluginError(f"towncrier build --draft failed:\n{done.stderr}")
        rendered = done.stdout
        start = rendered.find("\n### ")
        if start < 0:
            raise PluginError(f"towncrier build --draft printed no section:\n{rendered}")
        rendered = rendered[start + 1 :]
    # A fragment of several lines is several paragraphs of one entry: towncrier indents
    # the lines after the first by two spaces, which Markdown reads as one paragraph;
    # and an entry after one of several paragraphs needs a blank line before it.
    rendered = re.sub(r"\n  (?=\S)", "\n\n    ", rendered)
    rendered = re.sub(r"\n(?=- )", "\n\n", rendered)
    rendered = _demote_to(rendered, 3)
    return "## Unreleased\n\n" + rendered.strip()


def _demote_to(markdown: str, level: int) -> str:
    return re.sub(r"^#+ ", "#" * level + " ", markdown, flags=re.MULTILINE)


def _render_fragments(fragments: list[tuple[str, str, str]]) -> str:
    """What towncrier's draft says, for a checkout without towncrier installed."""
    parts = []
    for directory, title in _fragment_types():
        entries = [(issue, text) for issue, kind, text in fragments if kind == directory]
        if not entries:
            continue
        parts += [f"### {title}", ""]
        for issue, text in sorted(entries, key=lambda e: int(e[0])):
            parts.append(f"- {text.replace(chr(10), chr(10) + '  ')} (#{issue})")
        parts.append("")
    return "\n".join(parts)


# -- the hook -------------------------------------------------------------------------------


def _results_section(title: str) -> str:
    """The section ``## TITLE`` of ``benchmarks/RESULTS.md``, as its study wrote it there
    (the before/after and transport studies are not sections of results.json)."""
    text = (BENCHMARKS / "RESULTS.md").read_text(encoding="utf-8")
    start = text.find(f"\n## {title}")
    if start < 0:
        raise PluginError(f"benchmarks/RESULTS.md has no section '## {title}'")
    end = text.find("\n## ", start + 1)
    body = text[start : end if end >= 0 else len(text)].split("\n", 2)[2]
    return _blank_before_lists(_demote(body.strip()))


def layers_markdown() -> str:
    return _results_section("Before and after the layers move (issue 34)")


def layers_cost_markdown() -> str:
    return _results_section("Where the gateway's batch cost went after the layers move (issue 34)")


def transports_markdown() -> str:
    return _results_section(
        "HTTP/1.1 clients under trio at fan-out: the providers' Transport against httpcore (issue 34)"
    )


GENERATORS: dict[str, Callable[[], str]] = {
    "layers": layers_markdown,
    "layerscost": layers_cost_markdown,
    "transports": transports_markdown,
    "cli": cli_markdown,
    "http": http_markdown,
    "events": events_markdown,
    "performance": performance_markdown,
    "changelog": changelog_markdown,
}

#: The pages that must hold their marker.
PAGES = {
    "reference/cli.md": "cli",
    "reference/http.md": "http",
    "reference/events.md": "events",
    "performance.md": "performance",
    "changelog.md": "changelog",
}


def on_files(files: Files, config: Any) -> Files:
    """Serve the benchmark charts beside the performance page."""
    for chart in sorted(BENCHMARKS.glob("*.png")):
        files.append(File.generated(config, f"{CHARTS_URI}/{chart.name}", abs_src_path=str(chart)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    expected = PAGES.get(page.file.src_uri)
    found = MARKER.findall(markdown)
    if expected is not None and expected not in found:
        raise PluginError(
            f"{page.file.src_uri}: the marker '<!-- generated: {expected} -->' is missing"
        )
    for name in found:
        if name not in GENERATORS:
            raise PluginError(
                f"{page.file.src_uri}: unknown marker '<!-- generated: {name} -->'; "
                f"known: {', '.join(GENERATORS)}"
            )

    def generate(match: re.Match[str]) -> str:
        return GENERATORS[match[1]]().strip()

    return MARKER.sub(generate, markdown)
