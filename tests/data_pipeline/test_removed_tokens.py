"""Tokens of what the filters removed (data stats' per-filter token column), against an independent count: the
removed documents and cut lines, known by construction, encoded with sentencepiece itself on the build's
tokenizer file."""

from __future__ import annotations

import json
import random

import pytest
import sentencepiece as spm

from data_pipeline.build.config import BuildConfig, SourceConfig, TokenizerConfig
from data_pipeline.build.dedup import DedupConfig
from data_pipeline.build.ingest_stage import REMOVED_SAMPLE
from data_pipeline.build.removed_tokens import RemovedSample, count_removed_tokens
from data_pipeline.build.run import run_build
from data_pipeline.cli import format_stats
from data_pipeline.tokenizer import Tokenizer

WORDS = ("river stone market garden window letter morning island teacher engine village winter harvest "
         "bridge forest kitchen mountain station history music paper lantern doctor ocean valley").split()
VERBS = "carried painted opened watched followed visited crossed repaired described remembered".split()
NAV = ["Home", "About us", "Contact", "Sign in"]


def _sentence(rng: random.Random) -> str:
    w = [rng.choice(WORDS) for _ in range(5)]
    return (f"The {w[0]} near the {w[1]} {rng.choice(VERBS)} a {w[2]} and the old {w[3]} "
            f"{rng.choice(VERBS)} every {w[4]} of the year {rng.randrange(1800, 2000)}.")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    rng = random.Random(0)
    root = tmp_path_factory.mktemp("removed")
    pages, cut, dropped = [], [], []
    for _ in range(40):  # kept pages: navigation lines (C4 cuts them) above six sentences
        nav = rng.sample(NAV, 2)
        pages.append("\n".join(nav + [_sentence(rng) for _ in range(6)]))
        cut.append("\n".join(nav))
    for i in range(6):  # dropped whole: lorem ipsum (C4), and too few words (Gopher)
        lorem = " ".join(["Lorem ipsum dolor sit amet.", *(_sentence(rng) for _ in range(5))])
        dropped.append(("c4.lorem_ipsum", lorem))
        dropped.append(("gopher_quality.word_count", f"Short page number {i} about the {rng.choice(WORDS)}."))
    texts = pages + [t for _, t in dropped]
    (root / "web.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = BuildConfig(output_dir=str(root / "out"), workers=1, shard_docs=16, dedup=DedupConfig(near=False),
                      sources=[SourceConfig(name="web", path=str(root / "web.jsonl"), profile="web")],
                      tokenizer=TokenizerConfig(vocab_size=300, sample_chars=60_000))
    manifest = run_build(cfg)
    sp = spm.SentencePieceProcessor(model_file=str(root / "out" / manifest["tokenizer"]["path"]))
    return root, manifest, sp, cut, dropped


def test_tokens_per_filter_equal_an_independent_count(built) -> None:  # type: ignore[no-untyped-def]
    _, manifest, sp, cut, dropped = built
    t, d = manifest["sources"]["web"]["tokens"], manifest["sources"]["web"]["documents"]
    assert d["filtered"] == {"c4.lorem_ipsum": 6, "gopher_quality.word_count": 6} and d["kept"] == 40
    for reason in d["filtered"]:
        want = sum(len(sp.encode(text)) + 1 for r, text in dropped if r == reason)  # + EOS, as kept documents
        assert t["filtered"][reason] == want, reason
    assert t["trimmed"] == {"c4.lines": sum(len(sp.encode(c)) for c in cut)}
    assert t["estimated"] == []  # every removed piece fit in the sample: exact counts
    table = format_stats(manifest)
    row = next(ln for ln in table.splitlines() if "trim c4.lines" in ln)
    assert row.split()[-1] == f"{t['trimmed']['c4.lines']:,}"


def test_a_large_rule_is_estimated_from_its_sample(built) -> None:  # type: ignore[no-untyped-def]
    root, manifest, sp, cut, _ = built
    sample = RemovedSample(seed=0, size=8)
    for c in cut:
        sample.add("c4.lines", c)
    sample.save(root / "small.jsonl")
    tok = Tokenizer(root / "out" / manifest["tokenizer"]["path"])
    got = count_removed_tokens([root / "small.jsonl"], tok)
    exact = sum(len(sp.encode(c)) for c in cut)
    assert got["estimated"] == ["c4.lines"] and abs(got["trimmed"]["c4.lines"] - exact) <= 0.15 * exact
    assert len(list((root / "out" / "work" / "ingest" / "web").glob(REMOVED_SAMPLE))) == 1
    halves = [RemovedSample(seed=1, size=8), RemovedSample(seed=2, size=30)]  # a split ingest's two parts add up
    for i, c in enumerate(cut):
        halves[i % 2].add("c4.lines", c)
    for i, h in enumerate(halves):
        h.save(root / f"half-{i}.jsonl")
    got = count_removed_tokens([root / "half-0.jsonl", root / "half-1.jsonl"], tok)
    assert got["estimated"] == ["c4.lines"] and abs(got["trimmed"]["c4.lines"] - exact) <= 0.15 * exact
    assert "~" in format_stats({**manifest, "sources": {"web": {**manifest["sources"]["web"], "tokens": {
        **manifest["sources"]["web"]["tokens"], "trimmed": got["trimmed"], "estimated": got["estimated"]}}}})
