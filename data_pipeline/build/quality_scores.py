"""The quality classifier's scores in the ingest stage: stored per document, summed up per source, and the
top-fraction cut, which needs every score of a source and so is made once all its ingest units are done.

Files under `<output_dir>/work/ingest/<source>/` (data_pipeline/build/ingest_stage.py has the rest):
    unit-U.scores.jsonl       every document of unit U the classifier scored, in order: {"w": where, "s": score,
                              "r": the rule that dropped it, or null when kept}
    unit-U.candidates.jsonl   (top_fraction) the documents of unit U that passed every filter, with their score,
                              written here instead of shards until the cut is known
    scores.jsonl              the source's scores, every `where` the file's own line number, each with its outcome
                              after the cut (written when the source is finished)
    removed_sample-quality.jsonl   a sample of the text the cut removed (data_pipeline/build/removed_tokens.py)
The source's counts.json gets "quality": the scores' distribution (`quality.distribution`), the cutoff (the
threshold, or the lowest kept score of the top fraction) and the documents kept at the quality step.
A document the cut drops is counted filtered as `quality.top_fraction` with the characters it still had (what line
rules trimmed from it before stays counted as trimmed), so the accounting keeps adding up.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any

from data_pipeline.build.quality import QualityFilter, distribution, top_fraction_cut
from data_pipeline.build.removed_tokens import RemovedSample
from data_pipeline.build.shard_files import _rebase, _ShardWriter

CUT = "quality.top_fraction"
SCORES = "scores.jsonl"


def _unit(u: int) -> str:
    return f"unit-{u:05d}"


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] if path.is_file() else []


class UnitScores:
    """One ingest unit's scores (and, with top_fraction, its candidate documents)."""

    def __init__(self, out: Path, u: int, c: QualityFilter) -> None:
        self.defer = c.top_fraction is not None
        self.scores = open(out / f"{_unit(u)}.scores.jsonl", "w", encoding="utf-8")
        self.candidates: IO[str] | None = (open(out / f"{_unit(u)}.candidates.jsonl", "w", encoding="utf-8")
                                           if self.defer else None)

    def add(self, where: str, score: float, reason: str | None) -> None:
        self.scores.write(json.dumps({"w": where, "s": score, "r": reason}) + "\n")

    def candidate(self, text: str, where: str) -> None:
        assert self.candidates is not None
        self.candidates.write(json.dumps({"t": text, "w": where}, ensure_ascii=False) + "\n")

    def close(self) -> None:
        self.scores.close()
        if self.candidates is not None:
            self.candidates.close()


def finish_scores(out: Path, bases: list[int], total: dict[str, Any], c: QualityFilter, shard_docs: int,
                  seed: int) -> list[dict[str, Any]]:
    """A finished source's scores: the top-fraction cut (its shards written from the candidates, `total`'s
    counts moved from kept to filtered for what it drops), scores.jsonl and `total["quality"]`. Returns samples of
    the dropped documents for filtered.jsonl. Safe to run again after a kill (the shards are rewritten)."""
    units = [_rows(out / f"{_unit(u)}.scores.jsonl") for u in range(len(bases))]
    cutoff: float | None = 0.5 if c.threshold is None else c.threshold
    samples: list[dict[str, Any]] = []
    if c.top_fraction is not None:
        keep, low = top_fraction_cut([r["s"] for rows in units for r in rows if r["r"] is None], c.top_fraction)
        cutoff = low
        removed, i = RemovedSample(seed), 0
        for u, rows in enumerate(units):
            for old in out.glob(f"shard-{u:05d}-*"):
                old.unlink()
            writer = _ShardWriter(out, f"shard-{u:05d}", shard_docs)
            cand = iter(_rows(out / f"{_unit(u)}.candidates.jsonl"))
            for row in rows:
                if row["r"] is not None:
                    continue
                doc = next(cand)
                if keep[i]:
                    writer.add(doc["t"], doc["w"])
                else:
                    row["r"] = CUT
                    _drop(total, doc["t"])
                    removed.add(CUT, doc["t"])
                    samples.append({"reason": CUT, "where": _rebase(doc["w"], bases[u]), "chars": len(doc["t"]),
                                    "score": row["s"]})
                i += 1
            writer.flush()
            total["shards"] += writer.k
        removed.save(out / "removed_sample-quality.jsonl")
    scored = [r for rows in units for r in rows]
    tmp = out / f"{SCORES}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for u, rows in enumerate(units):
            for r in rows:
                f.write(json.dumps({**r, "w": _rebase(r["w"], bases[u])}) + "\n")
    tmp.replace(out / SCORES)
    total["quality"] = {**distribution([r["s"] for r in scored]), "cutoff": cutoff,
                        "by": "top_fraction" if c.top_fraction is not None else "threshold",
                        "kept": sum(r["r"] is None or not r["r"].startswith("quality.") for r in scored)}
    return samples


def _drop(total: dict[str, Any], text: str) -> None:
    total["kept"] -= 1
    total["filtered"][CUT] += 1
    total["chars"]["after_filters"] -= len(text)
    total["chars"]["filtered"][CUT] += len(text)
