"""benchmarks.against's arithmetic and its RESULTS.md section; nothing here runs or times a
workload (the tool itself is run by hand: ``python -m benchmarks.against --against REV``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.against import (
    SECTION,
    Row,
    median,
    parse_args,
    ratios,
    table,
    verdict,
    write_section,
)


def test_ratio_is_the_median_of_the_rounds_paired_ratios() -> None:
    row = Row("w", "f", before=[10.0, 20.0, 10.0], after=[11.0, 20.0, 30.0])
    assert ratios(row) == [1.1, 1.0, 3.0]
    assert median(ratios(row)) == 1.1
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5


@pytest.mark.parametrize(
    ("ratio", "expected"),
    [
        (1.0, "✅ within 5% (+0.0%)"),
        (1.049, "✅ within 5% (+4.9%)"),
        (0.96, "✅ within 5% (-4.0%)"),
        (1.2, "❌ 20% slower"),
        (0.8, "✅ 20% faster"),
    ],
)
def test_verdict_passes_within_five_percent_and_says_how_much_slower(
    ratio: float, expected: str
) -> None:
    assert verdict(ratio) == expected


def test_table_has_one_line_per_figure_with_medians_ratio_and_range() -> None:
    rows = [
        Row("gate", "µs per proposal", before=[4.0, 5.0], after=[4.8, 6.5]),
        Row("gate", "instructions per proposal", before=[33_000.0], after=[33_100.0]),
    ]
    lines = table(rows).splitlines()
    assert len(lines) == 4
    assert "| gate | µs per proposal | 4.50 | 5.65 | 1.250 | 1.200–1.300 | ❌ 25% slower |" in lines
    assert lines[3].endswith("| 1.003 | – | ✅ within 5% (+0.3%) |")


def test_write_section_appends_then_replaces_only_its_own_section(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    path.write_text("# results\n\n## Goals\n\ngoals\n", encoding="utf-8")
    write_section(f"{SECTION}\n\nfirst", path)
    assert (
        path.read_text(encoding="utf-8")
        == f"# results\n\n## Goals\n\ngoals\n\n{SECTION}\n\nfirst\n"
    )
    path.write_text(path.read_text(encoding="utf-8") + "\n## Later\n\nkept\n", encoding="utf-8")
    write_section(f"{SECTION}\n\nsecond", path)
    text = path.read_text(encoding="utf-8")
    assert "first" not in text
    assert text == f"# results\n\n## Goals\n\ngoals\n\n{SECTION}\n\nsecond\n\n## Later\n\nkept\n"


def test_unknown_workload_and_no_rounds_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--against", "HEAD", "--only", "steps"])
    assert "unknown workload 'steps'; choose from step, gate" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--against", "HEAD", "--rounds", "0"])
    assert "--rounds 0: give at least 1" in capsys.readouterr().err
    assert parse_args(["--against", "HEAD", "--quick"]).rounds == 2
