"""bench/sections.py: a bench rewrites only its own marked block; every bench's key has exactly one block in docs/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench.sections import markers, replace_section

ROOT = Path(__file__).resolve().parents[2]

PAGE = """# Pipeline bubble

Intro a reader wrote.

<!-- bench:pipeline-bubble -->
## Pipeline bubble

| schedule | idle |
|---|---:|
| GPipe | 0.250 |
<!-- /bench:pipeline-bubble -->

Analysis written after the run: GPipe idles a quarter of the step.

<!-- bench:zeropp -->
## ZeRO++
old zeropp table
<!-- /bench:zeropp -->

## A hand-written section
kept as it is
"""


def test_rewrites_only_its_block_and_keeps_the_text_around_it(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    new = "## Pipeline bubble\n\n| schedule | idle |\n|---|---:|\n| GPipe | 0.249 |\n| 1F1B | 0.233 |\n"
    replace_section(page, "pipeline-bubble", new)
    text = page.read_text()
    assert "| GPipe | 0.249 |\n| 1F1B | 0.233 |\n<!-- /bench:pipeline-bubble -->" in text
    assert "0.250" not in text
    # The reader's text before and after the block, the other bench's block and the hand-written section survive.
    assert text.startswith("# Pipeline bubble\n\nIntro a reader wrote.\n\n<!-- bench:pipeline-bubble -->\n")
    assert "<!-- /bench:pipeline-bubble -->\n\nAnalysis written after the run" in text
    assert "old zeropp table" in text and text.endswith("## A hand-written section\nkept as it is\n")
    replace_section(page, "pipeline-bubble", new)  # idempotent
    assert page.read_text() == text


def test_the_heading_can_change_without_the_bench_losing_its_block(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(PAGE.replace("## ZeRO++\n", "### ZeRO++ at 4 ranks (reworded)\n"))
    replace_section(page, "zeropp", "## ZeRO++\nnew zeropp table")
    text = page.read_text()
    assert "old zeropp table" not in text and "reworded" not in text
    assert text.count("<!-- bench:zeropp -->") == 1 and "## ZeRO++\nnew zeropp table\n<!-- /bench:zeropp -->" in text


def test_appends_a_missing_block_and_creates_a_missing_file(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    replace_section(page, "zero-overlap", "## ZeRO-3 overlap\nrows")
    block = "<!-- bench:zero-overlap -->\n## ZeRO-3 overlap\nrows\n<!-- /bench:zero-overlap -->\n"
    assert page.read_text() == PAGE + "\n" + block
    fresh = tmp_path / "fresh.md"
    replace_section(fresh, "compile", "## Compile\nrows\n")
    assert fresh.read_text() == "# Benchmarks\n\n<!-- bench:compile -->\n## Compile\nrows\n<!-- /bench:compile -->\n"


@pytest.mark.parametrize("broken", [
    PAGE.replace("<!-- /bench:zeropp -->\n", ""),                      # opening marker alone
    PAGE + "<!-- bench:zeropp -->\nagain\n<!-- /bench:zeropp -->\n",  # the block twice
    PAGE.replace("<!-- bench:zeropp -->", "@@").replace("<!-- /bench:zeropp -->", "<!-- bench:zeropp -->")
    .replace("@@", "<!-- /bench:zeropp -->"),                          # closing marker first
])
def test_damaged_markers_are_refused_and_the_file_is_left_alone(tmp_path: Path, broken: str) -> None:
    page = tmp_path / "page.md"
    page.write_text(broken)
    with pytest.raises(ValueError, match="bench:zeropp"):
        replace_section(page, "zeropp", "## ZeRO++\nnew")
    assert page.read_text() == broken


def test_keys_are_plain_names() -> None:
    assert markers("bf16-all-gather") == ("<!-- bench:bf16-all-gather -->", "<!-- /bench:bf16-all-gather -->")
    for bad in ["", "Zero", "issue 19", "a--b", "-a", "a-->"]:
        with pytest.raises(ValueError, match="lower-case"):
            markers(bad)


def test_every_bench_key_has_exactly_one_block_in_the_docs() -> None:
    keys = {m.group(2): path.name for path in sorted((ROOT / "bench").glob("*.py"))
            for m in re.finditer(r'^(\w*KEY) = "([^"]+)"', path.read_text(), re.M)}
    assert len(keys) >= 15, keys  # every bench that writes a block names its key the same way
    docs = {p: p.read_text() for p in (ROOT / "docs").rglob("*.md")}
    for key, bench in keys.items():
        begin, end = markers(key)
        holders = [p.relative_to(ROOT) for p, text in docs.items() if begin in text]
        assert len(holders) == 1, f"{bench}: block {key!r} found in {holders}"
        text = docs[ROOT / holders[0]]
        assert text.count(begin) == 1 and text.count(end) == 1 and text.index(begin) < text.index(end), (bench, key)
