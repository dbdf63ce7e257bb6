"""A sentencepiece tokenizer trained the way a build trains one: byte fallback (any text round-trips, unseen
characters as bytes), identity normalization (spaces and case kept), newline and tab as their own pieces,
EOS 2 / BOS 1 / UNK 0 and no pad, the vocabulary size asked for."""

from __future__ import annotations

from pathlib import Path

from data_pipeline.tokenizer import Tokenizer, train_sentencepiece

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "corpora"


def test_trained_sentencepiece_round_trips_and_keeps_its_settings(tmp_path: Path) -> None:
    lines = [p for rel in ("README", "docs/guide.rst", "code/http_session.py")
             for p in (FIXTURE / rel).read_text().split("\n\n") if p.strip()]
    model = train_sentencepiece(lines, tmp_path / "tok.model", vocab_size=400, threads=1)
    tok = Tokenizer(model)
    assert tok.kind == "sentencepiece" and tok.vocab_size == 400
    assert (tok.unk_id, tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2, -1)
    assert tok.info().user_symbols == ("\n", "\t")
    for text in ("def f(x):\n\treturn  x * 12345", "Ünïcödé 日本語 🙂 — never seen", "  Two  Spaces\n\n"):
        ids = tok.encode(text)
        assert tok.decode(ids) == text  # byte fallback + identity normalization: nothing lost
        assert 0 not in ids  # never UNK
    assert tok.encode_docs(["a b"])[0][-1] == 2


def test_hf_bpe_smallest_vocabulary_is_bytes_specials_and_one_merge(tmp_path: Path) -> None:
    import pytest

    from data_pipeline.tokenizer import train_hf_bpe
    from framework.base.errors import ConfigError

    lines = ["abc abd abe"] * 20
    with pytest.raises(ConfigError, match="vocab_size=257 must be > 256 bytes"):
        train_hf_bpe(lines, tmp_path / "a" / "tokenizer.json", vocab_size=257)
    out = train_hf_bpe(lines, tmp_path / "b" / "c" / "tokenizer.json", vocab_size=258)  # folders made
    assert Tokenizer(out).decode(Tokenizer(out).encode("abc abd")) == "abc abd"
