"""The dedup ground truth is independent of Tessera's tokenizer and hits its targets; the data benches run (--dry)."""

from __future__ import annotations

import importlib.util
import json
import random
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from bench.dedup_eval import (
    _lib_dirs,
    jaccard_histogram,
    make_corpus,
    mutate,
    true_jaccard,
    truth_shingles,
)
from data_pipeline.build.shingles import word_hashes

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _bench(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_truth_uses_its_own_tokens_not_tessera_words() -> None:
    assert truth_shingles("def f(x): return x") == {("def", "f(x):", "return", "x")}  # whitespace tokens, one shingle
    a = "alpha beta gamma delta epsilon zeta eta theta"
    b = "Alpha beta gamma delta epsilon zeta eta theta"  # Tessera lower-cases: identical words, not truth tokens
    wa, wb = (re.findall(r"\w+", t.lower()) for t in (a, b))
    assert wa == wb and true_jaccard(a, b) == pytest.approx(3 / 5)  # 4 shingles each, 3 shared
    c = "alpha, beta gamma delta epsilon zeta eta theta"  # punctuation: a different token, the same words
    assert true_jaccard(a, c) == pytest.approx(3 / 5)


def test_mutated_copies_land_on_their_target() -> None:
    rng = random.Random(3)
    words = [f"w{rng.randrange(3000)}" for _ in range(400)]
    text = " ".join(words)
    for target in (0.55, 0.65, 0.75, 0.85, 0.93):
        copy = mutate(text, target, rng)
        assert copy != text and abs(true_jaccard(text, copy) - target) < 0.05, (target, true_jaccard(text, copy))


def test_the_peers_get_tessera_words() -> None:
    dedup = _bench("dedup_vs_peers")
    texts = ["Hello, world! x_1 = café(2)", "", "naïve--Ünïcode words_here — “quoted” 3.14"]
    wh, first = word_hashes(texts)
    for k, text in enumerate(texts):
        ours = wh[first[k]:first[k + 1]]
        theirs = dedup.words(text)
        assert len(theirs) == len(ours)
        for i in range(len(ours)):
            for j in range(len(ours)):
                assert (ours[i] == ours[j]) == (theirs[i] == theirs[j])
    assert dedup.shingles("a b c d e f") and len(dedup.shingles("a b c d e f")) == 2


def test_natural_pairs_across_python_versions() -> None:
    if len([d for d in _lib_dirs() if (d / "json" / "decoder.py").is_file()]) < 3:
        pytest.skip("fewer than three Python installations on this machine: no natural cross-version pairs")
    bench = make_corpus("code", 200, seed=1, only="code:json/")
    hist = jaccard_histogram(bench)
    natural = [j for (_, _, j), o in zip(bench.pairs, bench.origin, strict=True) if o == "natural"]
    assert len(bench.texts) == 200 and len(natural) >= 5 and min(natural) >= 0.5
    assert any(0.6 <= j < 0.8 for j in natural) or "natural" in hist  # hard negatives or at least real pairs
    assert "generated" in hist and all(bench.groups[a] == bench.groups[b] for (a, b, _), o
                                       in zip(bench.pairs, bench.origin, strict=True) if o == "natural")


def test_dedup_bench_dry(tmp_path: Path) -> None:
    dedup = _bench("dedup_vs_peers")
    out = tmp_path / "rows.json"
    assert dedup.main(["--dry", "--corpus", "code", "--skip", "datatrove", "datasketch", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["corpora"]["code"]["rows"]
    best, probe = rows[dedup.DEFAULT_ROW], rows[dedup.PROBE_ROW]
    for row in (best, probe):
        assert row["recall@0.8"] >= 0.9 and row["shared_shingle_precision@0.7"] >= 0.99 and row["removed"] > 0
        assert 0.5 < row["pair_precision@0.7"] <= 1  # truth tokens disagree with the shingles near 0.7
    assert rows["tessera plain"]["candidates"] <= probe["candidates"]  # the probe only adds candidates
    # The sweep re-clusters the default's own verified candidates: at the default threshold it is the default row.
    from data_pipeline.build.minhash import MinHashConfig

    assert dedup.VERIFY == MinHashConfig().verify_threshold and dedup.PRECISION_AT == 0.7
    sweep = json.loads(out.read_text())["corpora"]["code"]["threshold_sweep"]["thresholds"]
    at_default = sweep[f"{dedup.VERIFY:.2f}"]
    for key in ("recall@0.8", "removal_recall@0.8", "pair_precision@0.7", "removed", "split_pairs@0.8"):
        assert at_default[key] == best[key], key
    assert sorted(sweep) == [f"{t:.2f}" for t in dedup.SWEEP]
    assert sweep[f"{dedup.SWEEP[0]:.2f}"]["removed"] > sweep[f"{dedup.SWEEP[-1]:.2f}"]["removed"]  # fewer edges


def test_loader_bench_dry_asserts_equal_batches(capsys: pytest.CaptureFixture[str]) -> None:
    loader = _bench("loader_throughput")
    assert loader.main(["--dry"]) == 0
    assert "all asserted equal" in capsys.readouterr().out


def test_scaling_bench_corpus_and_config(tmp_path: Path) -> None:
    import yaml

    from data_pipeline.build.config import load_build_config

    scaling = _bench("build_scaling")
    scaling.write_corpus(tmp_path / "c", 60, sources=2, files=3, seed=0)
    files = sorted((tmp_path / "c").rglob("*.jsonl"))
    lines = [json.loads(x)["text"] for f in files for x in f.read_text().splitlines()]
    assert len(lines) == 60 and len({*lines}) < 60  # exact copies are in
    cfg_path = tmp_path / "b.yaml"
    cfg_path.write_text(yaml.safe_dump(scaling.config(tmp_path / "out", tmp_path / "c", 2)))
    cfg = load_build_config(cfg_path)
    assert [s.name for s in cfg.sources] == ["s0", "s1"] and cfg.workers == 1
