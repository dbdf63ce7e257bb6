"""The smoke job's downstream task: pick the real next line of a standard-library file among four.

Built from the data build's held-out documents only (`data_pipeline.read.prepare.val_mask`, the validation split,
never trained on; every source of the build unless `sources` names some): for a line, the context is the up
to `context_lines` lines before it, the choices are the real line and three other lines of the same file
(other files fill in for short ones), in a seeded random order. Same build + seed -> the same items.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np

from framework.base.errors import DataError

NAME = "stdlib-nextline"


def _candidates(lines: list[str], min_chars: int) -> list[int]:
    return [i for i, line in enumerate(lines) if len(line.strip()) >= min_chars]


def build_nextline_task(build_dir: str | Path, val_fraction: float, *, n_items: int = 400, seed: int = 0,
                        sources: list[str] | None = None, context_lines: int = 6, min_chars: int = 12,
                        n_choices: int = 4, distractors: str = "same_file", max_choice_tokens: int | None = None
                        ) -> list[dict[str, Any]]:
    """Task items (the JSONL objects of framework/infer/tasks.py) from the held-out documents of `sources`.

    `max_choice_tokens`: an item with a longer choice is passed over, so every choice fits the run's sequence
    length beside some context (the trainer passes data.seq_len // 2). Only the chosen lines are tokenized.
    """
    from data_pipeline.indexed import IndexedTokens
    from data_pipeline.read.prepare import read_manifest, val_mask
    from data_pipeline.tokenizer import Tokenizer

    build_dir = Path(build_dir)
    manifest = read_manifest(build_dir)
    names = sources or sorted(manifest["sources"])
    sp = Tokenizer(build_dir / Path(manifest["tokenizer"]["path"]).name)
    eos = sp.eos_id

    def fits(line: str) -> bool:
        return max_choice_tokens is None or len(sp.encode(line)) <= max_choice_tokens
    docs, where = [], []
    for name in names:
        tokens = IndexedTokens(build_dir / name)
        for i in np.flatnonzero(val_mask(np.load(build_dir / f"{name}.hash.npy"), val_fraction)).tolist():
            lines = sp.decode([int(t) for t in tokens[i] if int(t) != eos]).split("\n")
            docs.append((lines, _candidates(lines, min_chars)))
            where.append((name, i))
    pool = [lines[j] for lines, cand in docs for j in cand]
    rng = random.Random(seed)
    targets = [(d, j) for d, (_, cand) in enumerate(docs) for j in cand if j >= 2]
    rng.shuffle(targets)
    items: list[dict[str, Any]] = []
    for d, j in targets:
        lines, cand = docs[d]
        real = lines[j]
        others = [] if distractors == "other_files" else list(
            dict.fromkeys(lines[k] for k in cand if lines[k].strip() != real.strip()))
        rng.shuffle(others)
        while len(others) < n_choices - 1:
            pick = rng.choice(pool)
            fresh = distractors == "same_file" or pick not in lines
            if pick.strip() != real.strip() and pick not in others and fresh:
                others.append(pick)
        choices = [real, *others[:n_choices - 1]]
        if not all(fits(c) for c in choices):
            continue
        rng.shuffle(choices)
        context = "\n".join(lines[max(0, j - context_lines):j]) + "\n"
        items.append({"context": context, "choices": choices, "label": choices.index(real),
                      "source": where[d][0], "doc": where[d][1], "line": j})
        if len(items) >= n_items:
            break
    if len(items) < n_items:
        raise DataError(f"the held-out documents of {names} in {build_dir} give only {len(items)} next-line "
                        f"items, {n_items} requested; raise data.val_fraction or lower the item count")
    return items


def write_task(items: list[dict[str, Any]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(item) + "\n" for item in items))
    tmp.replace(path)
    return path
