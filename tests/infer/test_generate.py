"""`tessera generate`: greedy decoding equals transformers' `generate` on the HF export (dense and MoE), the
KV cache equals recomputation, batching equals one prompt at a time, sampling is seeded and filters like HF."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from framework.base.errors import ConfigError
from framework.cli import main
from framework.config import load_config
from framework.infer.generate import SamplingConfig, filter_logits, generate, load_generator
from framework.testing.tiny import TINY
from framework.train.trainer import Trainer

PROMPTS = [[5, 17, 9, 300, 41, 7], [88], [3, 3, 3, 120]]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _train_and_export(tmp: Path, *overrides: str) -> tuple[Path, Path]:
    run, hf_dir = tmp / "run", tmp / "hf"
    Trainer(load_config(TINY, [f"run.dir={run}", "train.steps=3", "checkpoint.interval=0", "train.lr=3e-3",
                               *overrides])).train()
    assert main(["ckpt", "export-hf", str(run), str(hf_dir)]) == 0
    return run, hf_dir


@pytest.mark.parametrize("preset", ["test-tiny", "test-moe"])
def test_greedy_matches_transformers_generate(tmp_path: Path, preset: str) -> None:
    from transformers import AutoModelForCausalLM

    extra = ["model.moe.topk_renormalize=true"] if preset == "test-moe" else []
    run, hf_dir = _train_and_export(tmp_path, f"model.preset={preset}", *extra)
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    model, _ = load_generator(run)
    cfg = SamplingConfig(max_new_tokens=12)
    ours = generate(model, PROMPTS, cfg)  # one left-padded batch
    for prompt, got in zip(PROMPTS, ours, strict=True):
        ids = torch.tensor([prompt])
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert got == theirs, (prompt, got, theirs)
    assert ours == generate(model, PROMPTS, SamplingConfig(max_new_tokens=12, use_cache=False))
    # stop at EOS: pick the token greedy emits 4th in row 0 as "EOS"; that row ends there, as in transformers
    eos = ours[0][3]
    stopped = generate(model, PROMPTS, cfg, eos_id=eos)
    first = ours[0].index(eos)
    assert stopped[0] == ours[0][:first + 1]
    ids = torch.tensor([PROMPTS[0]])
    theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                         eos_token_id=eos, pad_token_id=0)[0, len(PROMPTS[0]):].tolist()
    assert theirs[:len(stopped[0])] == stopped[0] and all(t == 0 for t in theirs[len(stopped[0]):])
    for row, full in zip(stopped[1:], ours[1:], strict=True):
        assert row == (full[:full.index(eos) + 1] if eos in full else full)


def test_sampling_is_seeded_and_filters_like_transformers(tmp_path: Path) -> None:
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(4, 512, generator=torch.Generator().manual_seed(1)) * 3
    for k in (1, 5, 50):
        assert torch.equal(filter_logits(logits, top_k=k), TopKLogitsWarper(k)(None, logits.clone()))
    for p in (0.1, 0.5, 0.9):
        ours = filter_logits(logits, top_p=p).isfinite()
        theirs = TopPLogitsWarper(p)(None, logits.clone()).isfinite()
        assert torch.equal(ours, theirs), p

    run = tmp_path / "run"
    Trainer(load_config(TINY, [f"run.dir={run}", "train.steps=2", "checkpoint.interval=0"])).train()
    model, _ = load_generator(run)
    cfg = SamplingConfig(max_new_tokens=16, temperature=1.0, top_k=40, top_p=0.95, seed=7)
    a, b = generate(model, PROMPTS, cfg), generate(model, PROMPTS, cfg)
    c = generate(model, PROMPTS, SamplingConfig(max_new_tokens=16, temperature=1.0, top_k=40, top_p=0.95, seed=8))
    assert a == b and a != c
    assert all(len(row) == 16 for row in a)

    out = tmp_path / "out.jsonl"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("5 17 9\n88\n")
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["generate", str(run), "--prompts-file", str(prompts), "--ids", "--json",
                     "--max-new-tokens", "5", "--temperature", "1", "--seed", "7"]) == 0
    rows = [json.loads(line) for line in buf.getvalue().splitlines()]
    out.write_text(buf.getvalue())
    assert [len(r["tokens"]) for r in rows] == [5, 5]
    assert rows[0]["tokens"] == generate(model, [[5, 17, 9], [88]], SamplingConfig(
        max_new_tokens=5, temperature=1.0, seed=7))[0]
    with pytest.raises(ConfigError, match="max_seq_len"):
        generate(model, [[1] * 10], SamplingConfig(max_new_tokens=10_000))
    assert main(["generate", str(run), "--prompt", "hello"]) == 2  # synthetic data: no tokenizer


def test_cli_streams_text_with_the_runs_tokenizer(stdlib_build: object, tmp_path: Path) -> None:
    import contextlib
    import io

    cache = Path(stdlib_build.cfg.cache_dir)  # type: ignore[attr-defined]
    run = tmp_path / "run"
    Trainer(load_config(TINY, [f"run.dir={run}", "train.steps=2", "checkpoint.interval=0", "data.kind=stdlib",
                               f"data.cache_dir={cache}", "data.seq_len=64", "data.vocab_size=4096",
                               "model.vocab_size=4096", "model.mtp_depth=1"])).train()
    streamed = io.StringIO()
    with contextlib.redirect_stdout(streamed):
        assert main(["generate", str(run), "--prompt", "def main(", "--max-new-tokens", "6"]) == 0
    assert streamed.getvalue().startswith("def main(")
    batched = io.StringIO()
    with contextlib.redirect_stdout(batched):
        assert main(["generate", str(run), "--prompt", "def main(", "--prompt", "import os\n", "--json",
                     "--max-new-tokens", "6"]) == 0
    rows = [json.loads(line) for line in batched.getvalue().splitlines()]
    assert [r["prompt"] for r in rows] == ["def main(", "import os\n"]
    assert all(len(r["tokens"]) == 6 or r["tokens"][-1] == 2 for r in rows)
    assert streamed.getvalue() == "def main(" + rows[0]["completion"] + "\n"  # batch == alone, greedy
    drafted, report = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(drafted), contextlib.redirect_stderr(report):
        assert main(["generate", str(run), "--prompt", "def main(", "--prompt", "import os\n", "--json",
                     "--max-new-tokens", "6", "--draft-tokens", "1"]) == 0
    assert drafted.getvalue() == batched.getvalue()  # MTP drafts change the forwards, not the greedy text
    assert "drafts accepted" in report.getvalue()
