"""The ingest stage split across array tasks: units are numbered across sources in config order and task K of N
ingests exactly the units g with g % N == K (so sources of one unit each still spread over the tasks, and no
task is idle while another holds two units), every unit once; and the ingested shards are the 1-task build's,
byte for byte (the split preserves the output)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from data_pipeline.build.config import BuildConfig, SourceConfig, TokenizerConfig
from data_pipeline.build.run import run_build


def _sources(root: Path) -> list[SourceConfig]:
    rng = random.Random(0)

    def doc() -> str:
        return " ".join(f"w{rng.randrange(300)}" for _ in range(40)) + "."

    (root / "a").mkdir()
    for f in range(2):  # a directory of 2 jsonl files: 2 units
        (root / "a" / f"p{f}.jsonl").write_text("".join(json.dumps({"text": doc()}) + "\n" for _ in range(5)))
    (root / "b.jsonl").write_text("".join(json.dumps({"text": doc()}) + "\n" for _ in range(4)))  # 1 unit
    (root / "c").mkdir()
    for i in range(5):  # a text tree of 5 files at shard_docs=2: 3 units
        (root / "c" / f"f{i}.txt").write_text(doc())
    return [SourceConfig(name="a", path=str(root / "a"), profile="minimal"),
            SourceConfig(name="b", path=str(root / "b.jsonl"), profile="minimal"),
            SourceConfig(name="c", path=str(root / "c"), glob="*.txt", profile="minimal")]


def _cfg(root: Path, out: str, sources: list[SourceConfig]) -> BuildConfig:
    return BuildConfig(output_dir=str(root / out), sources=sources, shard_docs=2, workers=1,
                       tokenizer=TokenizerConfig(vocab_size=300))


def _units_done(out: Path) -> set[tuple[str, int]]:
    return {(p.parent.name, int(p.name[5:10])) for p in (out / "work/ingest").glob("*/unit-*.counts.json")}


def _ingested(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted((out / "work/ingest").rglob("*")) if p.is_file()}


def test_ingest_units_are_dealt_round_robin_across_sources_and_tasks(tmp_path: Path) -> None:
    sources = _sources(tmp_path)
    one = _cfg(tmp_path, "one", sources)
    run_build(one, stages=("ingest",), task=0, tasks=1)
    every = _units_done(tmp_path / "one")
    order = [("a", 0), ("a", 1), ("b", 0), ("c", 0), ("c", 1), ("c", 2)]  # the global unit numbering g
    assert every == set(order)

    tasks = 4
    four = _cfg(tmp_path, "four", sources)
    seen: set[tuple[str, int]] = set()
    for task in range(tasks):
        run_build(four, stages=("ingest",), task=task, tasks=tasks)
        now = _units_done(tmp_path / "four")
        mine = now - seen
        assert mine == {unit for g, unit in enumerate(order) if g % tasks == task}, (task, mine)
        seen = now
    assert seen == every
    assert _ingested(tmp_path / "four") == _ingested(tmp_path / "one")
