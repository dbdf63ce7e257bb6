"""Filter profiles against the hand-labelled sample (tests/fixtures/labelled): characters wrongly dropped and wrongly
kept per profile, held under bounds. The sample is text nobody on the project wrote, labelled by reading it (see the
fixture's README); the figures are in docs/DATA.md and docs/BENCHMARKS.md (bench/filter_labels.py prints them).

Bounds are regression bounds a little above the measured figures, each justified where it is asserted. The sample
is deterministic, so a change in a figure is a change in a filter, never noise.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from bench.filter_eval import kept_lines, load_labelled, score, score_profiles
from data_pipeline.build.filters import PROFILES, FiltersConfig

ROOT = Path(__file__).parents[1] / "fixtures" / "labelled"


@pytest.fixture(scope="module")
def docs():
    return load_labelled(ROOT)


@pytest.fixture(scope="module")
def scores(docs):
    return score_profiles(docs)


def test_sample_is_large_enough_and_records_its_origin(docs):
    sizes = {p: sum(d.profile == p for d in docs) for p in ("web", "docs", "code")}
    assert min(sizes.values()) >= 50, sizes
    assert (ROOT / "texts.jsonl").stat().st_size < 600_000
    for line in (ROOT / "texts.jsonl").read_text(encoding="utf-8").splitlines():
        d = json.loads(line)
        assert d["origin"] and d["licence"] and d["cut"], d["id"]
    # Each profile's sample holds documents it should drop whole, and (web) documents with lines to drop.
    for p in sizes:
        assert sum(not any(d.keep) for d in docs if d.profile == p) >= 5, p
    assert sum(any(d.keep) and not all(d.keep) for d in docs if d.profile == "web") >= 40


def test_code_profile(scores):
    s = scores["code"]
    # Measured 0 / 0: every hand-written file kept whole; generated (protoc, gencodec, idna-data), minified and
    # base64 files dropped. One wrongly judged file is ~2.7% of the characters to keep or ~10% of those to drop.
    assert s.wrongly_dropped_frac <= 0.01 and s.docs_wrongly_dropped == 0, s.worst
    assert s.wrongly_kept_frac <= 0.02 and s.docs_wrongly_kept == 0, s.worst


def test_docs_profile(scores):
    s = scores["docs"]
    # Measured 0% wrongly dropped: a documentation profile must not cut documentation.
    assert s.wrongly_dropped == 0 and s.docs_wrongly_dropped == 0, s.worst
    # Measured 23.5% of the characters to drop kept: a port table (/etc/services) and a metadata-header-only file,
    # which no language-neutral rule tells from prose; every blob, mojibake, replacement-character, hex and repeated-
    # paragraph document is dropped. One more such miss would add ~12 points.
    assert s.wrongly_kept_frac <= 0.25 and s.docs_wrongly_kept <= 2, s.worst


def test_web_profile(docs, scores):
    s = scores["web"]
    # Measured 1.7% of the characters to drop kept: C4's line rule removes the navigation, menus and footers.
    assert s.wrongly_kept_frac <= 0.03, s.worst
    # Measured 45.6% of the characters to keep dropped, by design of the reference rules: C4 drops every page with
    # a "{" (10 of the 19 pages dropped whole: pages with code examples, and one with a "{prefix}" path) and every
    # line not ending in punctuation (headings, list items, code lines). The bound holds today's recipe.
    assert s.wrongly_dropped_frac <= 0.47, s.worst
    assert s.reasons["c4.curly_bracket"] == 10
    # Without the curly-bracket rule the same pages keep their text at no cost in boilerplate kept (measured 27.7%
    # and 1.7%): the option docs/DATA.md gives for web text with code in it.
    cfg = FiltersConfig(c4=replace(FiltersConfig().c4, drop_curly_bracket=False))
    no_curly = score([d for d in docs if d.profile == "web"], PROFILES["web"], cfg)
    assert no_curly.wrongly_dropped_frac <= 0.29 and no_curly.wrongly_kept_frac <= 0.03
    assert no_curly.wrongly_dropped < s.wrongly_dropped - 10_000


def test_kept_lines_maps_output_back_and_refuses_a_rewritten_text():
    assert kept_lines("a\nb\nc\nb", "b\nb") == [False, True, False, True]
    assert kept_lines("a\nb", None) == [False, False]
    with pytest.raises(ValueError, match="not a subsequence"):
        kept_lines("a\nb", "a\nB")


def test_labels_are_checked(tmp_path):
    (tmp_path / "texts.jsonl").write_text(json.dumps({"id": "w-0", "profile": "web", "origin": "o", "licence": "l",
                                                      "cut": "whole", "text": "a\nb"}) + "\n")
    (tmp_path / "labels.txt").write_text("w-0 drop-lines 3\n")
    with pytest.raises(ValueError, match=r"outside 1\.\.2"):
        load_labelled(tmp_path)
    (tmp_path / "labels.txt").write_text("")
    with pytest.raises(ValueError, match="without a label"):
        load_labelled(tmp_path)
    (tmp_path / "labels.txt").write_text("w-0 drop-lines 2\n")
    [d] = load_labelled(tmp_path)
    assert d.keep == (True, False)
