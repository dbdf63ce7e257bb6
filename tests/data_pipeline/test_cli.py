"""`tessera data build/stats` and `tessera tokenizer train` end to end on tiny data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from data_pipeline.tokenizer import Tokenizer
from framework.cli import main


def _corpus(root: Path) -> Path:
    rng = np.random.default_rng(1)
    words = "river stone light cloud window garden bread music the of and to with that have be".split()
    with open(root / "docs.jsonl", "w") as f:
        for _ in range(40):
            f.write(json.dumps({"text": " ".join(rng.choice(words, 60)) + "."}) + "\n")
        f.write("{broken\n")
    return root / "docs.jsonl"


def test_data_build_stats_and_tokenizer_train(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _corpus(tmp_path)
    cfg = tmp_path / "build.yaml"
    cfg.write_text(f"output_dir: {tmp_path / 'out'}\nshard_docs: 16\nsources:\n"
                   f"  - {{name: words, path: {src}, profile: minimal}}\n"
                   f"tokenizer: {{vocab_size: 300, sample_chars: 100000}}\n")
    assert main(["data", "build", str(cfg), "--stages", "ingest,exact,minhash", "--task", "0", "--tasks", "1"]) == 0
    captured = capsys.readouterr()
    assert "stages ingest,exact,minhash done" in captured.out
    assert "] ingest words: 41 records, 40 kept after filters, 1 malformed" in captured.err, captured.err
    assert main(["data", "build", str(cfg), "workers=1"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "words" in out and "fingerprint" in out
    # stderr is not a terminal here: every stage still logs a line with its counts and time
    assert "ingest words: 41 records, 40 kept" not in captured.err  # ingest was done by the first call
    assert "] tokenize: 3 shards in " in captured.err, captured.err
    assert main(["data", "sample", str(tmp_path / "out"), "--source", "words", "-n", "2"]) == 0
    shown = capsys.readouterr().out
    assert shown.count("=== words document") == 2 and ("river" in shown or "stone" in shown)
    assert main(["data", "stats", str(tmp_path / "out")]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["source", "in", "kept"]
    row = table[2].split()
    assert row[0] == "words" and row[1] == "41" and row[6] == "1"  # 41 records in, 1 malformed
    by_rule = table[table.index("") + 1:]
    assert by_rule[0].split()[-1] == "tokens" and by_rule[2].split()[-1] == "-"  # a malformed record: never tokenized
    assert main(["data", "stats", str(tmp_path / "nope")]) == 2  # a typed error, not a traceback
    assert "DataError" in capsys.readouterr().err
    assert main(["data", "build", str(cfg), "--stages", "ingest,bogus"]) == 2
    model = tmp_path / "tok.model"
    assert main(["tokenizer", "train", str(src), "--out", str(model), "--vocab-size", "300"]) == 0
    assert Tokenizer(model).vocab_size == 300 and "vocab 300" in capsys.readouterr().out
    assert main(["tokenizer", "train", str(src), "--out", str(tmp_path / "bpe/tokenizer.json"), "--vocab-size",
                 "300", "--type", "hf_bpe"]) == 0
    hf = Tokenizer(tmp_path / "bpe/tokenizer.json")
    assert hf.kind == "hf" and hf.vocab_size == 300 and hf.decode(hf.encode("river stone")) == "river stone"


def test_data_sample_filtered_shows_what_a_rule_removed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _corpus(tmp_path)
    with open(src, "a") as f:  # a cookie banner scraped as a document of its own
        f.write(json.dumps({"text": "We use cookies. Accept all?"}) + "\n")
    cfg = tmp_path / "build.yaml"
    cfg.write_text(f"output_dir: {tmp_path / 'out'}\nsources:\n  - {{name: words, path: {src}, profile: minimal}}\n"
                   f"filters: {{length: {{min_chars: 40}}}}\ntokenizer: {{vocab_size: 300, sample_chars: 100000}}\n")
    assert main(["data", "build", str(cfg), "workers=1"]) == 0
    capsys.readouterr()
    assert main(["data", "sample", str(tmp_path / "out"), "--source", "words", "--filtered"]) == 0
    shown = capsys.readouterr().out
    assert f"=== length.too_short: {src}:42 (27 characters) ===\nWe use cookies. Accept all?\n" in shown, shown
