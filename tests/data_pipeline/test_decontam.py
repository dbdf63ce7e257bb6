"""Decontamination against evaluation sets, on real text: benchmark passages taken from documents nobody on the
project wrote (tests/fixtures/labelled: the machine's documentation; tests/fixtures/multilingual: translated
catalogues), planted in a corpus of other such documents exactly and lightly edited, found and removed (or their
lines masked), with per-benchmark counts in the manifest that add up; a clean corpus loses nothing."""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

import pytest

from data_pipeline.build.config import BuildConfig, SourceConfig, TokenizerConfig
from data_pipeline.build.decontam import DecontaminateFilter, decontaminate
from data_pipeline.build.filters import FiltersConfig
from data_pipeline.build.run import run_build
from data_pipeline.cli import cmd_sample, format_stats
from framework.base.errors import ConfigError

FIXTURES = Path(__file__).parents[1] / "fixtures"
# Documentation with prose paragraphs (of 40 words or more): man pages, READMEs, NEWS, licences.
DOCS = [t for t in (json.loads(x)["text"] for x in (FIXTURES / "labelled" / "texts.jsonl").read_text().splitlines()
                    if json.loads(x)["profile"] == "docs")
        if any(len(p.split()) >= 40 for p in re.split(r"\n\s*\n", t))]
CHINESE = [json.loads(x)["text"] for x in (FIXTURES / "multilingual" / "texts.jsonl").read_text().splitlines()
           if json.loads(x)["lang"] == "zh" and json.loads(x)["kind"] == "prose"]


def _paragraph(text: str, words: int = 40) -> str:
    """The first paragraph of `text` with at least `words` whitespace words (a passage a benchmark could hold)."""
    return next(p for p in re.split(r"\n\s*\n", text) if len(p.split()) >= words)


def _edit(passage: str, rng: random.Random) -> str:
    """Lightly edited: one word in 15 replaced, case changed, punctuation and line breaks moved."""
    words = passage.split()
    for i in range(7, len(words), 15):
        words[i] = rng.choice(["also", "often", "thus", "here"])
    return " ".join(words).upper().replace(".", " .").replace(",", "")


@pytest.fixture(scope="module")
def bench_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], list[str]]:
    """Two benchmark files: a multiple-choice task whose contexts are passages of documents 0-5 and a Chinese
    cloze set from catalogue documents 0-2; returns the folder and the English and Chinese passages."""
    root = tmp_path_factory.mktemp("bench")
    english = [_paragraph(d) for d in DOCS[:6]]
    items = [{"context": p[:len(p) // 2], "choices": [p[len(p) // 2:], " no."], "label": 0} for p in english]
    (root / "docs_mc.jsonl").write_text("".join(json.dumps(it) + "\n" for it in items))
    chinese = [d[:200] for d in CHINESE[:3]]
    (root / "zh_cloze.jsonl").write_text("".join(json.dumps({"context": p[:100], "continuation": p[100:]},
                                                            ensure_ascii=False) + "\n" for p in chinese))
    return root, english, chinese


def _config(root: Path, out: str, corpus: Path, dc: DecontaminateFilter) -> BuildConfig:
    return BuildConfig(output_dir=str(root / out), sources=[SourceConfig(name="docs", path=str(corpus),
                                                                         profile="minimal")],
                       shard_docs=32, workers=1, filters=FiltersConfig(decontaminate=dc),
                       tokenizer=TokenizerConfig(vocab_size=1500, sample_chars=100_000))


def test_planted_passages_are_found_and_a_clean_corpus_loses_nothing(
        tmp_path: Path, bench_files: tuple[Path, list[str], list[str]], capsys: pytest.CaptureFixture[str]) -> None:
    broot, english, chinese = bench_files
    benches = [str(broot / "docs_mc.jsonl"), str(broot / "zh_cloze.jsonl")]
    clean = DOCS[6:] + CHINESE[3:]  # documents the benchmarks were not taken from
    rng = random.Random(0)
    planted = [f"{DOCS[7][:300]}\n\n{english[0]}\n\n{DOCS[8][:300]}",  # exact, inside other text
               f"Notes.\n{_edit(english[1], rng)}\nEnd of notes.",  # lightly edited
               english[2].replace("\n", " "),  # re-wrapped
               f"前言。\n{chinese[0]}\n后记。"]  # Chinese, words are characters
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in clean + planted))
    clean_file = tmp_path / "clean.jsonl"
    clean_file.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in clean))

    m = run_build(_config(tmp_path, "clean", clean_file, DecontaminateFilter(benchmarks=benches)))
    plain = run_build(_config(tmp_path, "plain", clean_file, DecontaminateFilter()))
    assert "decontaminated" not in m["sources"]["docs"]["documents"]
    assert m["sources"]["docs"]["documents"]["kept"] == plain["sources"]["docs"]["documents"]["kept"] == len(clean)
    assert m["fingerprint"] == plain["fingerprint"]

    m = run_build(_config(tmp_path, "removed", corpus, DecontaminateFilter(benchmarks=benches)))
    docs, chars = m["sources"]["docs"]["documents"], m["sources"]["docs"]["chars"]
    assert docs["decontaminated"] == {"docs_mc": 3, "zh_cloze": 1}
    assert docs["kept"] == len(clean)
    assert chars["decontaminated"] == {"docs_mc": sum(map(len, planted[:3])), "zh_cloze": len(planted[3])}
    outcomes = docs["kept"] + sum(docs["filtered"].values()) + docs["exact_duplicate"] + docs["near_duplicate"] + \
        sum(docs["malformed"].values()) + sum(docs["decontaminated"].values())
    assert outcomes == docs["in"] == len(clean) + len(planted)
    assert re.search(r"docs +decontaminated docs_mc +3 ", format_stats(m)), format_stats(m)
    cmd_sample(argparse.Namespace(build=str(tmp_path / "removed"), source="docs", filtered=False, reason=None,
                                  decontaminated=True, n=3, chars=200, seed=0))
    shown = capsys.readouterr().out
    assert "docs_mc: 3 documents removed" in shown and "zh_cloze: 1 documents removed" in shown
    assert shown.count("decontaminate.docs_mc: ") == 3

    m = run_build(_config(tmp_path, "masked", corpus, DecontaminateFilter(benchmarks=benches, policy="mask")))
    docs, chars = m["sources"]["docs"]["documents"], m["sources"]["docs"]["chars"]
    assert docs["kept"] == len(clean) + 3  # the plants keep their other lines
    assert docs.get("decontaminated") == {"docs_mc": 1}  # the re-wrapped passage alone has none
    assert chars["trimmed"]["decontaminate.docs_mc"] >= len(english[0])
    assert chars["trimmed"]["decontaminate.zh_cloze"] >= len(chinese[0].replace("\n", "").replace(" ", ""))
    cmd_sample(argparse.Namespace(build=str(tmp_path / "masked"), source="docs", filtered=False, reason=None,
                                  decontaminated=True, n=3, chars=200, seed=0))
    shown = capsys.readouterr().out
    assert "docs_mc: 1 documents removed" in shown and "zh_cloze: 0 documents removed" in shown
    assert f"{chars['trimmed']['decontaminate.zh_cloze']:,} characters of lines masked" in shown
    mask = DecontaminateFilter(benchmarks=benches, policy="mask")
    for plant, before, after in ((planted[0], DOCS[7][:300], DOCS[8][:300]), (planted[3], "前言。", "后记。")):
        kept, reason = decontaminate(plant, mask)
        assert reason is not None and [ln for ln in (kept or "").split("\n") if ln.strip()] == \
            [ln for ln in f"{before}\n{after}".split("\n") if ln.strip()]


def test_what_counts_as_an_overlap(bench_files: tuple[Path, list[str], list[str]]) -> None:
    broot, english, _ = bench_files
    dc = DecontaminateFilter(benchmarks=[str(broot / "docs_mc.jsonl")])
    words = english[3].split()
    assert decontaminate(" ".join(words[5:18]), dc)[1] == "decontaminate.docs_mc"  # 13 words in a row
    assert decontaminate(" ".join(words[5:17]), dc)[1] is None  # 12
    assert decontaminate(" ".join([*words[5:11], "zebra", *words[12:19]]), dc)[1] is None  # no 13 unbroken
    assert decontaminate(" ".join(words[5:18]), DecontaminateFilter(benchmarks=dc.benchmarks, min_ngrams=2))[1] \
        is None
    with pytest.raises(ConfigError, match="not a file"):
        DecontaminateFilter(benchmarks=["missing.jsonl"]).validate()
    with pytest.raises(ConfigError, match="ngram"):
        DecontaminateFilter(ngram=3).validate()
