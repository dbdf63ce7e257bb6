"""`tessera ckpt` end to end: HF export (logit parity with transformers), import round trip, tokenizer, convert."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from framework.base.errors import CheckpointError
from framework.checkpoint.hf import check_exportable, export_tokenizer, load_model, resolve_checkpoint
from framework.cli import main
from framework.config import load_config
from framework.testing.tiny import TINY
from framework.train.trainer import Trainer
from models.config import model_config

pytestmark = pytest.mark.usefixtures("one_thread")


def _train(run: Path, *overrides: str) -> None:
    Trainer(load_config(TINY, [f"run.dir={run}", "train.steps=2", "checkpoint.interval=0", *overrides])).train()


@pytest.mark.parametrize("preset", ["test-tiny", "test-moe"])
def test_export_hf_logits_match_transformers_and_import_round_trips(tmp_path: Path, preset: str) -> None:
    from transformers import AutoModelForCausalLM

    overrides = [f"model.preset={preset}", "model.tied_embeddings=true"] if preset == "test-tiny" else [
        f"model.preset={preset}", "model.moe.topk_renormalize=true"]
    run, hf_dir, imported = tmp_path / "run", tmp_path / "hf", tmp_path / "imported"
    _train(run, *overrides)
    assert main(["ckpt", "export-hf", str(run), str(hf_dir), "--step", "2"]) == 0
    hf_cfg = json.loads((hf_dir / "config.json").read_text())
    assert hf_cfg["model_type"] == ("llama" if preset == "test-tiny" else "mixtral")

    model, _ = load_model(resolve_checkpoint(run, 2))
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    assert type(hf).__name__ == ("LlamaForCausalLM" if preset == "test-tiny" else "MixtralForCausalLM")
    tokens = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)

    assert main(["ckpt", "import-hf", str(hf_dir), str(imported)]) == 0
    back, meta = load_model(resolve_checkpoint(imported))
    assert meta["model_only"] and meta["step"] == 0
    a, b = model.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def test_imported_model_trains_with_a_fresh_optimizer(tmp_path: Path) -> None:
    run, hf_dir, imported = tmp_path / "run", tmp_path / "hf", tmp_path / "imported"
    _train(run)
    assert main(["ckpt", "export-hf", str(run), str(hf_dir)]) == 0
    assert main(["ckpt", "import-hf", str(hf_dir), str(imported)]) == 0
    trainer = Trainer(load_config(TINY, [f"run.dir={imported}", "train.steps=1", "train.warmup_steps=0",
                                             "checkpoint.interval=0"]))
    result = trainer.train()
    assert result.start_step == 0 and result.final_step == 1
    assert "holds model weights only" in (imported / "train.log").read_text()


@pytest.mark.parametrize(("field", "value"), [
    ("moe.topk_renormalize", None), ("moe.n_shared_experts", 1), ("moe.router", "sigmoid"),
    ("moe.capacity_factor", 1.25), ("moe.first_dense_layers", 1), ("mlp", "gelu")])
def test_export_refuses_what_the_target_cannot_hold(field: str, value: object) -> None:
    if field.startswith("moe."):
        moe = {"n_experts": 4, "top_k": 2, "expert_hidden": 64, "topk_renormalize": True, field[4:]: value}
        if field == "moe.router":
            moe["topk_renormalize"] = None
        cfg = model_config("test-moe", moe=moe)
    else:
        cfg = model_config("test-tiny", **{field: value})
    with pytest.raises(CheckpointError, match=rf"model\.{field}="):
        check_exportable(cfg)
    assert check_exportable(model_config("test-tiny")) == "llama"


def test_exported_tokenizer_matches_sentencepiece(stdlib_build: object, tmp_path: Path) -> None:
    import sentencepiece as spm
    from transformers import AutoTokenizer

    model_file = Path(stdlib_build.build_dir) / "tokenizer.model"  # type: ignore[attr-defined]
    export_tokenizer(model_file, tmp_path / "hf")
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    rng = random.Random(0)
    texts = ["  leading spaces", "\n\tindented", "héllo wörld 12345 漢字 🙂", "a  b   c"]
    for module in (json, random, pytest):
        lines = Path(module.__file__ or "").read_text().splitlines()
        for _ in range(60):
            i = rng.randrange(len(lines))
            texts.append("\n".join(lines[i:i + rng.randint(1, 8)]))
    mismatched = [t for t in texts if hf(t, add_special_tokens=False).input_ids != sp.encode(t)]
    assert not mismatched, mismatched[:3]
    ids = sp.encode(texts[5])
    assert hf.decode(ids) == texts[5] and hf.eos_token_id == sp.eos_id()


def test_convert_consolidates_and_resumes_identically(tmp_path: Path) -> None:
    run, conv, small = tmp_path / "run", tmp_path / "conv", tmp_path / "small"
    cfg = [f"run.dir={run}", "train.steps=6", "checkpoint.interval=2"]
    Trainer(load_config(TINY, cfg)).train(stop_at=4)
    assert main(["ckpt", "convert", str(run), str(conv)]) == 0
    assert len(list((conv / "checkpoints" / "step_4").glob("*.distcp"))) == 1
    assert main(["ckpt", "convert", str(run), str(small), "--model-only", "--dtype", "bf16"]) == 0
    assert main(["ckpt", "inspect", str(small), "--tensors"]) == 0
    a = Trainer(load_config(TINY, cfg)).train()
    b = Trainer(load_config(TINY, [*cfg, f"run.dir={conv}"])).train()
    assert a.start_step == b.start_step == 4 and a.losses == b.losses
