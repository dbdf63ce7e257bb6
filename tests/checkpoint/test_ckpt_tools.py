"""`tessera ckpt export-hf` and `tessera generate` as a user meets them: run from another directory than training
(the run's data path relative), on a truncated or crafted checkpoint, with a tokenizer that has no BOS token."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest

import data_pipeline.read.prepare
from framework.checkpoint.manifest import write_manifest
from framework.cli import main
from framework.testing.tiny import tiny_config
from framework.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def _no_data_preparation(*args: object, **kwargs: object) -> None:
    raise AssertionError("export-hf / generate prepared the training data")


def test_export_and_generate_find_the_tokenizer_from_another_directory(
        stdlib_build: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) \
        -> None:
    cache = Path(stdlib_build.cfg.cache_dir)  # type: ignore[attr-defined]
    work, elsewhere = tmp_path / "work", tmp_path / "home" / "user"  # a different depth: the relative path misses
    work.mkdir()
    elsewhere.mkdir(parents=True)
    monkeypatch.chdir(work)
    # The run names its cache relative to where it was started, as configs/ do (.cache/tessera).
    Trainer(tiny_config("runs/r", "data.kind=stdlib", f"data.cache_dir={os.path.relpath(cache, work)}",
                        "model.vocab_size=4096", "train.steps=2", "checkpoint.interval=1")).train()
    run = work / "runs" / "r"
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(data_pipeline.read.prepare, "prepare_data", _no_data_preparation)
    capsys.readouterr()
    assert main(["ckpt", "export-hf", str(run), "hf"]) == 0
    conf = json.loads((elsewhere / "hf" / "config.json").read_text())
    assert (elsewhere / "hf" / "tokenizer.model").is_file()
    assert (conf["bos_token_id"], conf["eos_token_id"]) == (1, 2)  # the sentencepiece model's <s> and </s>
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "def main(", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("def main(")
    # A checkpoint written before the paths were recorded: its data config's relative cache cannot be found
    # from here, and the message says what was looked at instead of waiting for a build.
    meta_file = run / "checkpoints" / "step_2" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta.pop("tokenizer")
    meta.pop("data_build_dir")
    meta_file.write_text(json.dumps(meta))
    write_manifest(meta_file.parent)  # as that older save committed it
    assert main(["generate", str(run / "checkpoints" / "step_2"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "CheckpointError: the tokenizer of" in err and "pass --tokenizer" in err and "manifest.json" in err
    monkeypatch.chdir(work)  # from the training directory the saved config still leads to the build's manifest
    assert main(["generate", str(run / "checkpoints" / "step_2"), "--prompt", "x", "--max-new-tokens", "1"]) == 0


def test_truncated_and_crafted_checkpoints_and_a_bos_less_tokenizer(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from data_pipeline.tokenizer import train_hf_bpe

    run = tmp_path / "run"
    Trainer(tiny_config(run, "train.steps=2", "checkpoint.interval=1")).train()
    # A byte-level BPE with an end-of-text token and no BOS (GPT-2 style): id 1 is a byte, not a BOS.
    tok = train_hf_bpe(Path(json.__file__).read_text().splitlines() * 2, tmp_path / "bpe" / "tokenizer.json",
                       vocab_size=400)
    assert main(["ckpt", "export-hf", str(run), str(tmp_path / "hf"), "--tokenizer", str(tok)]) == 0
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert conf["bos_token_id"] is None and conf["eos_token_id"] == 0, conf

    step2 = run / "checkpoints" / "step_2"
    good = step2.parent / "good"
    shutil.copytree(step2, good)
    data = next(step2.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:data.stat().st_size // 3])  # a copy cut short (disk full, scp killed)
    capsys.readouterr()
    ids = ["--ids", "--prompt", "1 2 3", "--max-new-tokens", "2"]
    assert main(["generate", str(run), *ids]) == 0  # latest fails its manifest: step_1 is used, as train would
    out = capsys.readouterr()
    said = out.out + out.err  # the warning goes where logging is set up (stdout after a Trainer in this process)
    assert "skipping checkpoint step_2" in said and data.name in said and "\n1 2 3 " in "\n" + out.out
    for args in (["generate", str(step2), *ids], ["ckpt", "export-hf", str(run), str(tmp_path / "x"), "--step", "2"]):
        assert main(args) == 2  # named explicitly: refused, naming the file and what is wrong with it
        err = capsys.readouterr().err
        assert f"CheckpointError: checkpoint file {data}" in err and "truncated" in err
        assert "Traceback" not in err
    # Crafted metadata of the right size (the manifest's size check passes): refused before torch reads it.
    shutil.rmtree(step2)
    good.rename(step2)
    meta_file = step2 / ".metadata"
    evil = pickle.dumps(type("X", (), {"__reduce__": lambda self: (os.system, ("true",))})())
    meta_file.write_bytes(evil + b"\0" * (meta_file.stat().st_size - len(evil)))
    assert main(["generate", str(step2), *ids]) == 2
    err = capsys.readouterr().err
    assert "not a DCP metadata type" in err and "Traceback" not in err, err


_FULL_DISK = """
import resource, signal, sys, torch
from pathlib import Path
from framework.checkpoint import dcp as ckpt
from framework.base.errors import CheckpointError
tmp = ckpt.begin_save(Path(sys.argv[1]), 1)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))  # writes past 200 kB fail, as on a full disk
try:
    ckpt.write_shards({"model": {"w": torch.randn(1000, 100)}}, tmp)
except CheckpointError as err:
    print(err)
"""


def test_a_save_that_runs_out_of_space_says_so(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FULL_DISK, str(tmp_path / "ckpt")], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert "no space left on device" in out.stdout and "GiB free under" in out.stdout, out.stdout + out.stderr
    assert "unexpected pos" in out.stdout  # torch's own words kept for the record, after the explanation
