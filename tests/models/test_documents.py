"""Per-document attention (data.document_mask): a packed row computes what each of its documents computes alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from data_pipeline.config import DataConfig
from framework.base.errors import ConfigError, DataError
from framework.config import load_config
from framework.testing.tiny import TINY
from framework.train.documents import resolve_documents
from framework.train.local_engine import LocalEngine
from models.config import ModelConfig
from models.decoder import build_model
from models.documents import DocumentMasking, block_causal_mask, document_ids, document_positions

REPO = Path(__file__).resolve().parents[2]
EOD = 511
# Document lengths (without their EOD) of two packed rows of 33 tokens (inputs 32 + the last label): the first
# segment stands for the tail of a document cut by packing, a 0 is a document that is only an EOD, and the last
# document of a row runs past it (no EOD).
ROWS = [6, 4, 0, 8, 2, 8]
ROWS2 = [15, 1, 15]


def _packed(lengths: list[int], seed: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """A row of seq_len + 1 = 33 tokens and the (start, end) input span of each document."""
    gen = torch.Generator().manual_seed(seed)
    row: list[int] = []
    spans = []
    for i, n in enumerate(lengths):
        body = torch.randint(0, EOD, (n,), generator=gen).tolist()  # random non-EOD content
        start = len(row)
        row += body if i == len(lengths) - 1 else [*body, EOD]
        spans.append((start, min(len(row), 32)))
    assert len(row) == 33, len(row)
    return torch.tensor(row), spans


def _model_cfg() -> ModelConfig:
    return load_config(TINY).model


def test_document_ids_positions_and_mask_golden() -> None:
    tokens = torch.tensor([[4, EOD, EOD, 6, 7, EOD, 8], [1, 2, 3, 4, 5, 6, 7]])
    doc = document_ids(tokens, EOD)
    assert doc.tolist() == [[0, 0, 1, 2, 2, 2, 3], [0] * 7]  # an EOD belongs to the document it ends
    assert document_positions(doc).tolist() == [[0, 1, 0, 0, 1, 2, 0], list(range(7))]
    mask = block_causal_mask(doc)
    assert mask.shape == (2, 1, 7, 7)
    assert torch.equal(mask[1, 0], torch.ones(7, 7, dtype=torch.bool).tril())  # one document: plain causal
    assert mask[0, 0, 4].tolist() == [False, False, False, True, True, False, False]
    assert mask[0, 0, 2].tolist() == [False, False, True, False, False, False, False]


@pytest.mark.parametrize("reset_positions", [False, True])
def test_packed_rows_equal_documents_alone(reset_positions: bool) -> None:
    """Per-token logits and loss of packed rows (masked) equal each document run alone, fp32, <= 1e-5."""
    torch.manual_seed(0)
    cfg = _model_cfg()
    model = build_model(cfg, seed=3)
    (row1, spans1), (row2, spans2) = _packed(ROWS, 1), _packed(ROWS2, 2)
    batch = torch.stack([row1, row2])  # (B, T+1)
    inputs, labels = batch[:, :-1], batch[:, 1:]
    documents = DocumentMasking(eod_id=EOD, mask=True, reset_positions=reset_positions)
    with torch.no_grad():
        packed = model(inputs, **documents.model_kwargs(inputs))
        unmasked = model(inputs)
        alone = torch.zeros_like(packed)
        for b, spans in enumerate([spans1, spans2]):
            for start, end in spans:
                if end > start:
                    alone[b, start:end] = model(inputs[b:b + 1, start:end])[0]
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)
    assert (unmasked - alone).abs().max() > 1e-2  # without the mask the later documents see the earlier ones
    # Loss: every label counts, as without masking; an EOD's label is the next document's first token.
    per_token = F.cross_entropy(packed.flatten(0, 1), labels.flatten(), reduction="none")
    want = F.cross_entropy(alone.flatten(0, 1), labels.flatten(), reduction="none")
    torch.testing.assert_close(per_token, want, atol=1e-5, rtol=0)
    engine = LocalEngine(cfg, load_config(TINY).train, torch.device("cpu"), documents)
    engine.model.load_state_dict(model.state_dict())
    assert abs(engine.eval_loss(batch[None]) - float(want.mean())) <= 1e-5


def test_reset_positions_without_mask_restarts_rope() -> None:
    """reset_position_ids alone: the first document is unchanged, later ones differ from plain positions."""
    cfg = _model_cfg()
    model = build_model(cfg, seed=3)
    row, spans = _packed(ROWS, 1)
    inputs = row[None, :-1]
    documents = DocumentMasking(eod_id=EOD, mask=False, reset_positions=True)
    kwargs = documents.model_kwargs(inputs)
    assert set(kwargs) == {"positions"}
    with torch.no_grad():
        reset, plain = model(inputs, **kwargs), model(inputs)
    first_end = spans[0][1]
    torch.testing.assert_close(reset[:, :first_end], plain[:, :first_end], atol=1e-6, rtol=0)
    assert (reset[:, first_end:] - plain[:, first_end:]).abs().max() > 1e-3


def test_resolve_documents_and_bad_configs() -> None:
    assert resolve_documents(DataConfig(), 2, 512) is None
    spec = resolve_documents(DataConfig(document_mask=True), 2, 512)
    assert spec == DocumentMasking(eod_id=2, mask=True, reset_positions=False)
    spec = resolve_documents(DataConfig(document_mask=True, reset_position_ids=True, eod_id=7), None, 512)
    assert spec == DocumentMasking(eod_id=7, mask=True, reset_positions=True)
    for eos in (None, -1):  # data without an end-of-document token
        with pytest.raises(DataError, match=r"data.document_mask=true .* set data.eod_id .* data.document_mask=false"):
            resolve_documents(DataConfig(document_mask=True, kind="build", build_dir="x"), eos, 512)
    with pytest.raises(DataError, match=r"data.reset_position_ids=false"):
        resolve_documents(DataConfig(reset_position_ids=True), None, 512)
    with pytest.raises(ConfigError, match=r"outside model.vocab_size=512"):
        resolve_documents(DataConfig(document_mask=True), 600, 512)
    with pytest.raises(ConfigError, match=r"data.eod_id=512 is outside model.vocab_size=512"):
        load_config(TINY, ["data.document_mask=true", "data.eod_id=512"])
    with pytest.raises(ConfigError, match=r"data.eod_id=-3 must be a token id >= 0"):
        load_config(TINY, ["data.eod_id=-3"])


def test_trainer_refuses_document_mask_on_a_build_without_eos(tmp_path: Path) -> None:
    """A build whose tokenizer names no EOS: the trainer stops with a DataError that names the fixes."""
    import json

    import numpy as np

    from data_pipeline.indexed import IndexedWriter
    from framework.train.trainer import Trainer

    build = tmp_path / "build"
    build.mkdir()
    writer = IndexedWriter(build / "web", 512)
    for i in range(20):
        writer.add(np.arange(i, i + 40) % 500)
    writer.finalize()
    np.save(build / "web.hash.npy", np.full(20, np.iinfo(np.uint64).max, dtype=np.uint64))  # none held out
    (build / "manifest.json").write_text(json.dumps({
        "sources": {"web": {}}, "fingerprint": "hand-made", "tokenizer": {"vocab_size": 512, "path": "tok.model"}}))
    overrides = [f"run.dir={tmp_path / 'run'}", "data.kind=build", f"data.build_dir={build}", "data.weights={web: 1.0}",
                 "data.document_mask=true"]
    with pytest.raises(DataError, match=r"eos_id=-1\) and data.eod_id is null; set data.eod_id"):
        Trainer(load_config(TINY, overrides))
    assert Trainer(load_config(TINY, [*overrides, "data.eod_id=3"])).engine.documents == DocumentMasking(eod_id=3)


def test_trainer_runs_with_document_mask(tmp_path: Path) -> None:
    """The trainer resolves the synthetic data's EOS (vocab_size - 1) and trains with the mask."""
    from framework.train.trainer import Trainer

    cfg = load_config(TINY, [f"run.dir={tmp_path / 'run'}", "train.steps=2", "checkpoint.interval=0",
                             "data.document_mask=true", "data.reset_position_ids=true"])
    trainer = Trainer(cfg)
    assert trainer.engine.documents == DocumentMasking(eod_id=511, mask=True, reset_positions=True)  # type: ignore
    result = trainer.train()
    assert sorted(result.losses) == [1, 2] and all(loss == loss for loss in result.losses.values())
