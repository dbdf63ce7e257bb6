"""Resolving `data.document_mask` / `data.reset_position_ids` against the prepared data's end-of-document token.

The config cannot know the EOD id of a tokenizer that is trained or read at run time, so the engines take a
`DocumentMasking` resolved here after the data is prepared (the trainer) or from the config alone (tests).
"""

from __future__ import annotations

from data_pipeline.config import DataConfig
from framework.base.errors import ConfigError, DataError
from models.documents import DocumentMasking


def resolve_documents(cfg: DataConfig, eos_id: int | None, vocab_size: int) -> DocumentMasking | None:
    """The document split the engines apply, or None when neither option is on.

    Args:
        cfg: The data section (`document_mask`, `reset_position_ids`, `eod_id`).
        eos_id: The data's end-of-document token (tokenizer EOS; synthetic data: vocab_size - 1); None or a
            negative id when the data has none.
        vocab_size: model.vocab_size (the EOD id must be a valid token).

    Raises:
        DataError: A document option is on but neither `data.eod_id` nor the data names an EOD token.
        ConfigError: The EOD id is not a token of the model's vocabulary.
    """
    if not (cfg.document_mask or cfg.reset_position_ids):
        return None
    eod = cfg.eod_id if cfg.eod_id is not None else eos_id
    on = "data.document_mask" if cfg.document_mask else "data.reset_position_ids"
    if eod is None or eod < 0:
        raise DataError(
            f"{on}=true splits packed rows at the end-of-document token, but the data (data.kind={cfg.kind!r}) has "
            f"none (tokenizer eos_id={eos_id}) and data.eod_id is null; set data.eod_id to the token id that ends "
            f"each document, rebuild the data with a tokenizer that has an EOS piece, or set {on}=false")
    if not 0 <= eod < vocab_size:
        raise ConfigError(f"{on}: end-of-document id {eod} is outside model.vocab_size={vocab_size}; set "
                          f"data.eod_id to a token id below {vocab_size}")
    return DocumentMasking(eod_id=eod, mask=cfg.document_mask, reset_positions=cfg.reset_position_ids)


__all__ = ["resolve_documents"]
