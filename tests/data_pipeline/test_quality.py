"""Model-based quality scoring on real text (tests/fixtures/labelled: documentation prose and source files nobody on
the project wrote): a fastText classifier trained on two sources scores a third and the filter keeps what scores
high; a DCLM-format .bin made with fastText itself loads and scores as fastText scores it; scores, and the build,
are the same as 1 and 3 ingest tasks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.build.config import BuildConfig, SourceConfig, TokenizerConfig
from data_pipeline.build.filters import FiltersConfig, apply_filters
from data_pipeline.build.quality import (
    NEGATIVE,
    POSITIVE,
    QualityFilter,
    load_classifier,
    score,
    top_fraction_cut,
)
from data_pipeline.build.run import run_build
from framework.base.errors import ConfigError
from framework.cli import main

fasttext = pytest.importorskip("fasttext", reason="the quality extra (fasttext-wheel) is not installed")

ROWS = [json.loads(x) for x in (Path(__file__).parents[1] / "fixtures" / "labelled" / "texts.jsonl").read_text()
        .splitlines()]
PROSE = [r["text"] for r in ROWS if r["profile"] == "docs"]
CODE = [r["text"] for r in ROWS if r["profile"] == "code"]


def _jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_train_on_two_sources_score_a_third(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Prose against code: half of each trains the classifier (through the CLI), the other halves are the third
    source the filter sees."""
    pos, neg = _jsonl(tmp_path / "prose.jsonl", PROSE[::2]), _jsonl(tmp_path / "code.jsonl", CODE[::2])
    model = tmp_path / "quality.bin"
    assert main(["data", "train-quality", "--positive", str(pos), "--negative", str(neg), "--out", str(model),
                 "--epoch", "25", "--lr", "1.0"]) == 0
    assert "positive" in capsys.readouterr().out
    cfg = FiltersConfig(quality=QualityFilter(model=str(model), threshold=0.5))
    kept_prose = sum(apply_filters(t, ("quality",), cfg)[0] is not None for t in PROSE[1::2])
    kept_code = sum(apply_filters(t, ("quality",), cfg)[0] is not None for t in CODE[1::2])
    assert kept_prose >= 0.9 * len(PROSE[1::2]), (kept_prose, len(PROSE[1::2]))  # 28 held-out documents
    assert kept_code <= 0.25 * len(CODE[1::2]), (kept_code, len(CODE[1::2]))  # 26
    assert apply_filters(CODE[1], ("quality",), FiltersConfig(quality=QualityFilter(model=str(model),
                                                                                    threshold=1.0)))[1] == \
        "quality.low_score"


def test_a_dclm_format_model_loads_and_scores_as_fasttext_does(tmp_path: Path) -> None:
    data = tmp_path / "train.txt"
    data.write_text("".join(f"{POSITIVE} {' '.join(t.split())}\n" for t in PROSE[:20]) +
                    "".join(f"{NEGATIVE} {' '.join(t.split())}\n" for t in CODE[:20]))
    path = tmp_path / "fasttext_oh_eli5.bin"
    fasttext.train_supervised(str(data), epoch=3, thread=1, seed=1, verbose=0).save_model(str(path))
    model = load_classifier(str(path))
    own = fasttext.load_model(str(path))
    for text in PROSE[20:25] + CODE[20:25]:
        line = " ".join(text.split())
        probs = dict((lab, p) for p, lab in own.f.predict(line, 2, 0.0, "strict"))
        assert score(text, model) == pytest.approx(probs[POSITIVE], abs=1e-6)
    with pytest.raises(ConfigError, match="does not exist"):
        QualityFilter(model=str(tmp_path / "nope.bin")).validate()


def test_scores_and_build_are_the_same_as_one_and_three_ingest_tasks(tmp_path: Path) -> None:
    model = tmp_path / "q.bin"
    from data_pipeline.build.quality import train_quality

    train_quality(PROSE[::2], CODE[::2], model, epoch=25, lr=1.0)
    corpus = _jsonl(tmp_path / "mixed.jsonl", [t for pair in zip(PROSE, CODE, strict=False) for t in pair])

    def build(out: str, tasks: int) -> dict:
        cfg = BuildConfig(output_dir=str(tmp_path / out), unit_bytes=16_384, workers=1, shard_docs=8,
                          sources=[SourceConfig(name="mix", path=str(corpus), filters=["length", "quality"])],
                          filters=FiltersConfig(quality=QualityFilter(model=str(model), threshold=0.5)),
                          tokenizer=TokenizerConfig(vocab_size=400, sample_chars=50_000))
        for k in range(tasks):
            run_build(cfg, stages=("ingest",), task=k, tasks=tasks)
        return run_build(cfg)

    one, three = build("one", 1), build("three", 3)
    assert one["fingerprint"] == three["fingerprint"]
    assert one["sources"]["mix"]["documents"] == three["sources"]["mix"]["documents"]
    assert 0 < one["sources"]["mix"]["documents"]["filtered"]["quality.low_score"] < len(CODE)
    q, low = one["sources"]["mix"]["quality"], one["sources"]["mix"]["documents"]["filtered"]["quality.low_score"]
    assert q == three["sources"]["mix"]["quality"]  # every document scored, by threshold (the default 0.5)
    assert (q["by"], q["cutoff"], q["count"], q["kept"]) == ("threshold", 0.5, q["count"], q["count"] - low)
    rows = [json.loads(x) for x in (tmp_path / "one/work/ingest/mix/scores.jsonl").read_text().splitlines()]
    assert sum(r["s"] < 0.5 for r in rows) == sum(r["r"] == "quality.low_score" for r in rows) == low


def test_a_hugging_face_classifier_scores_as_its_pipeline_does(tmp_path: Path) -> None:
    """A tiny BERT sequence classifier (random weights, a word-level tokenizer over the fixture's words) saved as a
    model folder: the filter's score is what transformers' text-classification pipeline gives the label."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({w for t in PROSE[:10] for w in t.lower().split()})
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *words])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]",
                                               cls_token="[CLS]", sep_token="[SEP]", model_max_length=512)
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=64, num_labels=2, id2label={0: "low", 1: "high"},
                                  label2id={"low": 0, "high": 1})
    folder = tmp_path / "classifier"
    transformers.BertForSequenceClassification(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    pipe = transformers.pipeline("text-classification", model=str(folder), top_k=None, device="cpu")
    quality = QualityFilter(model=str(folder), kind="hf", label="high", threshold=0.5)
    from data_pipeline.build.quality import hf_score

    for text in PROSE[10:14]:
        want = {r["label"]: r["score"] for r in pipe([text], truncation=True)[0]}["high"]
        assert hf_score(text, str(folder), "high") == pytest.approx(want, abs=1e-5)
        kept = apply_filters(text, ("quality",), FiltersConfig(quality=quality))[0] is not None
        assert kept == (want >= 0.5)
    with pytest.raises(ConfigError, match="labels"):
        hf_score(PROSE[0], str(folder), "__label__hq")


def test_top_fraction_keeps_the_best_scored_of_the_source_whatever_the_ingest_tasks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Train on two sources (prose, code), score a third (held-out prose and code, interleaved): the build keeps
    the ceil(0.4 n) documents fastText itself scores highest (earlier first among equals), the same ones with the
    same stored scores as 1 and 3 ingest tasks; the manifest's distribution is numpy's over the stored scores."""
    from data_pipeline.build.quality import train_quality

    model = train_quality(PROSE[::2], CODE[::2], tmp_path / "q.bin", epoch=25, lr=1.0)
    third = [t for pair in zip(PROSE[1::2], CODE[1::2], strict=False) for t in pair]
    corpus = _jsonl(tmp_path / "third.jsonl", third)
    own = fasttext.load_model(str(model))
    want = []
    for text in third:
        probs = {lab: p for p, lab in own.f.predict(" ".join(text.split()), 2, 0.0, "strict")}
        want.append(probs.get(POSITIVE, 0.0))
    k = -(-4 * len(third) // 10)
    top = sorted(sorted(range(len(third)), key=lambda i: (-want[i], i))[:k])

    def build(out: str, tasks: int) -> tuple[dict, list[dict]]:
        cfg = BuildConfig(output_dir=str(tmp_path / out), unit_bytes=16_384, workers=1, shard_docs=8,
                          sources=[SourceConfig(name="third", path=str(corpus), filters=["quality"])],
                          filters=FiltersConfig(quality=QualityFilter(model=str(model), top_fraction=0.4)),
                          tokenizer=TokenizerConfig(vocab_size=400, sample_chars=50_000))
        for task in range(tasks):
            run_build(cfg, stages=("ingest",), task=task, tasks=tasks)
        work = tmp_path / out / "work" / "ingest" / "third"
        assert len(json.loads((work / "units.json").read_text())["line_base"]) >= 3  # 3 tasks share the units
        return run_build(cfg), [json.loads(x) for x in (work / "scores.jsonl").read_text().splitlines()]

    one, rows = build("one", 1)
    three, rows3 = build("three", 3)
    assert rows == rows3 and one["fingerprint"] == three["fingerprint"]
    assert [r["w"] for r in rows] == [f"{corpus}:{i + 1}" for i in range(len(third))]
    assert [r["s"] for r in rows] == pytest.approx(want, abs=1e-6)
    assert [i for i, r in enumerate(rows) if r["r"] is None] == top
    docs = one["sources"]["third"]["documents"]
    assert (docs["kept"], docs["filtered"]) == (k, {"quality.top_fraction": len(third) - k})
    q = one["sources"]["third"]["quality"]
    scores = np.array([r["s"] for r in rows])
    for p in (1, 10, 25, 50, 75, 90, 99):
        assert q[f"p{p}"] == np.quantile(scores, p / 100)
    assert (q["count"], q["min"], q["max"], q["kept"]) == (len(third), scores.min(), scores.max(), k)
    assert q["cutoff"] == min(want[i] for i in top) == pytest.approx(sorted(want)[-k], abs=1e-6)
    assert main(["data", "stats", str(tmp_path / "one")]) == 0
    row = re.search(r"^third +top_fraction +(\d+) .* ([\d.]+) +(\d+)$", capsys.readouterr().out, re.M)
    assert row is not None and row.groups() == (str(len(third)), f"{q['cutoff']:.3f}", str(k))
    assert top_fraction_cut([0.5, 0.9, 0.5, 0.5, 0.1], 0.4) == ([True, True, False, False, False], 0.5)  # ties
    assert sum(top_fraction_cut([0.0] * 10, 0.3)[0]) == 3  # 0.3 x 10 is 3.0000000000000004 in floats
    with pytest.raises(ConfigError, match=r"both threshold=0\.5 and top_fraction=0\.4"):
        QualityFilter(threshold=0.5, top_fraction=0.4).validate()
