"""Downstream evaluation: the JSONL format and its errors, scores against an unbatched brute force, the in-loop
figures on one process and on TP2 x PP2 (equal), and the stdlib next-line task built from held-out documents."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from framework.base.errors import DataError
from framework.config import load_config
from framework.infer.generate import load_generator
from framework.infer.tasks import load_task, metrics, score_items
from framework.testing import run_distributed
from framework.testing.tiny import TINY
from framework.train.trainer import Trainer


def _write_tasks(tmp: Path) -> tuple[Path, Path]:
    rng = random.Random(0)
    mc, cloze = tmp / "mc.jsonl", tmp / "cloze.jsonl"
    lines = []
    for _ in range(30):
        k = rng.randint(2, 4)
        lines.append(json.dumps({"context_ids": [rng.randrange(511) for _ in range(rng.randint(3, 20))],
                                 "choices_ids": [[rng.randrange(511) for _ in range(rng.randint(1, 4))]
                                                 for _ in range(k)], "label": rng.randrange(k)}))
    mc.write_text("\n".join(lines) + "\n")
    cloze.write_text("".join(json.dumps({"context_ids": [rng.randrange(511) for _ in range(6)],
                                         "continuation_ids": [rng.randrange(511) for _ in range(2)]}) + "\n"
                             for _ in range(12)))
    return mc, cloze


@pytest.mark.parametrize(("line", "reason"), [
    ("{not json", "Expecting property name"),
    ('{"context_ids": [1, 2], "choices_ids": [[3], [4]], "label": 2}', "label=2"),
    ('{"context_ids": [1, 2], "choices_ids": [[3]], "label": 0}', ">= 2 choices"),
    ('{"context_ids": [1, 99999], "choices_ids": [[3], [4]], "label": 0}', "outside"),
    ('{"context": "def f():", "choices": ["a", "b"], "label": 0}', "tokenizer"),
    ('{"question": "?"}', "needs \\\"context\\\""),
    ('[1, 2]', "JSON object"),
])
def test_a_malformed_line_is_named_with_its_reason(tmp_path: Path, line: str, reason: str) -> None:
    path = tmp_path / "bad.jsonl"
    good = '{"context_ids": [1, 2], "choices_ids": [[3], [4]], "label": 1}'
    path.write_text(f"{good}\n\n{line}\n{good}\n")
    with pytest.raises(DataError, match=rf"bad\.jsonl:3: malformed task item: .*{reason}"):
        load_task(path, None, 512)


def test_scores_equal_an_unbatched_brute_force(tmp_path: Path) -> None:
    mc, cloze = _write_tasks(tmp_path)
    run = tmp_path / "run"
    Trainer(load_config(TINY, [f"run.dir={run}", "train.steps=2", "checkpoint.interval=0"])).train()
    model, _ = load_generator(run)
    task = load_task(mc, None, 512)
    rows = score_items(model, task.items, seq_len=16, batch_size=5, device=torch.device("cpu"), unconditional=[511])
    with torch.no_grad():
        for item, row in zip(task.items, rows, strict=True):
            alone = [float(F.log_softmax(model(torch.tensor([[511, *c[:-1]]]))[0], -1)[torch.arange(len(c)),
                                                                                      torch.tensor(c)].sum())
                     for c in item.choices]
            sums = []
            for ctx, choice in zip(item.contexts, item.choices, strict=True):
                seq = (ctx + choice)[-17:]  # the context is cut from the left to fit seq_len 16 (+1 target)
                logp = F.log_softmax(model(torch.tensor([seq[:-1]]))[0], -1)
                sums.append(sum(float(logp[len(seq) - 1 - len(choice) + j - 0, t])
                                for j, t in enumerate(choice)))
            norm = [s / len(c) for s, c in zip(sums, item.choices, strict=True)]
            assert row[0] == float(int(np.argmax(sums)) == item.label)
            assert row[1] == float(int(np.argmax(norm)) == item.label)
            assert abs(float(row[2]) - sums[item.label]) < 1e-4
            assert row[3] == float(int(np.argmax(np.array(sums) - np.array(alone))) == item.label)
    out = metrics("mc", rows, cloze=False)
    p = float(rows[:, 0].mean())
    assert out["downstream/mc/acc"] == p and out["downstream/mc/n"] == 30
    assert out["downstream/mc/acc_stderr"] == pytest.approx((p * (1 - p) / 29) ** 0.5)
    assert load_task(cloze, None, 512).items[0].cloze


def _train_ranks(rank: int, world: int, overrides: list[str]) -> dict[str, float]:
    torch.set_num_threads(1)
    return Trainer(load_config(TINY, overrides)).train().eval


@pytest.mark.distributed
def test_in_loop_figures_are_logged_and_equal_on_tp2_pp2(tmp_path: Path) -> None:
    mc, cloze = _write_tasks(tmp_path)
    common = ["train.steps=4", "train.eval_interval=2", "checkpoint.interval=0", f"eval.tasks=[{mc}, {cloze}]",
              "eval.mutual_info=true"]
    one = Trainer(load_config(TINY, [*common, f"run.dir={tmp_path / 'one'}"])).train().eval
    records = [json.loads(line) for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["type"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert all("downstream/mc/acc" in r and "downstream/cloze/acc" in r for r in evals)
    assert "downstream/cloze/acc_norm" not in evals[0] and "downstream/mc/acc_mutual_info" in evals[0]
    summary = [r for r in records if r["type"] == "summary"][-1]
    assert summary["downstream/mc/acc"] == one["downstream/mc/acc"]
    assert evals[0]["downstream/mc/loglik"] != evals[-1]["downstream/mc/loglik"]  # the weights did change

    par = run_distributed(_train_ranks, 4, timeout_s=300, overrides=[
        *common, f"run.dir={tmp_path / 'par'}", "parallel.tp=2", "parallel.pp=2"])
    for res in par:  # every rank reaches the 1-process figures
        for key, value in one.items():
            if key.startswith("downstream/") and key != "downstream/time_s":
                assert res[key] == pytest.approx(value, abs=1e-4), key


def test_stdlib_nextline_task_uses_held_out_documents_only(stdlib_build: object) -> None:
    from data_pipeline.read.prepare import val_mask
    from framework.infer.stdlib_task import build_nextline_task

    build_dir = Path(stdlib_build.build_dir)  # type: ignore[attr-defined]
    items = build_nextline_task(build_dir, 0.02, n_items=200)
    assert len(items) == 200
    held = {s: val_mask(np.load(build_dir / f"{s}.hash.npy"), 0.02) for s in ("code", "prose", "tests")}
    assert all(held[it["source"]][it["doc"]] for it in items)
    assert len({(it["source"], it["doc"]) for it in items}) > 20
    assert all(len(it["choices"]) == 4 and len(set(it["choices"])) == 4 for it in items)
    labels = [it["label"] for it in items]
    assert min(labels.count(k) for k in range(4)) > 25  # the answer's position is shuffled
    assert items == build_nextline_task(build_dir, 0.02, n_items=200)
