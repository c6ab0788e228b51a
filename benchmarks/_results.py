"""Writing a benchmark's section into ``benchmarks/RESULTS.md``."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def write_section(text: str, path: Path = RESULTS) -> None:
    """Put ``text`` into ``path``, replacing the earlier section of the same heading (its
    first line, ``## ...``) up to the next ``## ``; appended if there is none."""
    section = text.split("\n", 1)[0]
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    start = old.find(section + "\n")
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text + "\n"
    else:
        following = old.find("\n## ", start + len(section))
        rest = old[following + 1 :] if following >= 0 else ""
        new = old[:start] + text + "\n" + ("\n" + rest if rest else "")
    path.write_text(new, encoding="utf-8")
