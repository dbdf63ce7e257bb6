"""Sentencepiece tokenizers: training on a sample of text, loading, encoding with EOS between documents.

Trained with the identity normalization and no whitespace folding, so code keeps its indentation, and with
byte fallback, so no text is ever unknown. Newline and tab are user-defined pieces (sentencepiece trains on
lines, so it would otherwise never learn them and spend a byte-fallback token on every line break).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from framework.errors import ConfigError, DataError

USER_SYMBOLS = ("\n", "\t")


@dataclass(frozen=True)
class TokenizerInfo:
    """What a build records about its tokenizer (in the manifest)."""

    path: str
    vocab_size: int
    eos_id: int
    bos_id: int
    unk_id: int
    pad_id: int
    user_symbols: tuple[str, ...]
    sha256: str


def sample_lines(texts: Iterable[str], max_chars: int, seed: int = 0, keep: float = 1.0) -> list[str]:
    """Non-empty lines of `texts`, each kept with probability `keep`, until `max_chars` are collected."""
    rng = random.Random(seed)
    out: list[str] = []
    total = 0
    for text in texts:
        for line in text.split("\n"):
            if not line.strip() or (keep < 1.0 and rng.random() >= keep):
                continue
            out.append(line[:4000])
            total += len(line)
            if total >= max_chars:
                return out
    return out


def train_sentencepiece(lines: Sequence[str], out_path: str | Path, *, vocab_size: int,
                        model_type: str = "bpe", threads: int = 2) -> Path:
    """Train a sentencepiece model on `lines` and write it to `out_path` (a `.model` file), atomically.

    Args:
        lines: Training text, one sentence per item (newlines are learnt as the user-defined piece "\\n").
        out_path: Where the `.model` goes.
        vocab_size: Vocabulary size including the 256 byte-fallback pieces and specials.
        model_type: "bpe" or "unigram".
        threads: Trainer threads.
    """
    import io

    import sentencepiece as spm

    if vocab_size < 300:
        raise ConfigError(f"vocab_size={vocab_size} must be >= 300 (256 byte pieces plus specials); e.g. 4096")
    if not lines:
        raise DataError("no text to train the tokenizer on; every source is empty after filtering")
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size, model_type=model_type,
            byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True, split_digits=True, user_defined_symbols=list(USER_SYMBOLS),
            num_threads=threads, minloglevel=2, max_sentence_length=16384, hard_vocab_limit=False,
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    except RuntimeError as err:
        raise DataError(f"sentencepiece training failed ({err}); with a small sample, lower vocab_size") from err
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(model.getvalue())
    tmp.replace(out)
    return out


class Tokenizer:
    """A loaded sentencepiece model.

    Args:
        path: The `.model` file.
    """

    def __init__(self, path: str | Path) -> None:
        import sentencepiece as spm

        self.path = str(path)
        if not Path(self.path).is_file():
            raise DataError(f"tokenizer model {self.path!r} does not exist; train one with `tessera tokenizer "
                            f"train` or point tokenizer.model at a sentencepiece .model file")
        self._sp = spm.SentencePieceProcessor(model_file=self.path)
        self.vocab_size = int(self._sp.get_piece_size())
        self.eos_id = int(self._sp.eos_id())
        if self.eos_id < 0:
            raise DataError(f"tokenizer {self.path!r} has no EOS piece; retrain it with an eos_id")

    def info(self) -> TokenizerInfo:
        sp = self._sp
        user = tuple(s for s in USER_SYMBOLS if sp.piece_to_id(s) != sp.unk_id())
        digest = hashlib.sha256(Path(self.path).read_bytes()).hexdigest()
        return TokenizerInfo(self.path, self.vocab_size, self.eos_id, int(sp.bos_id()), int(sp.unk_id()),
                             int(sp.pad_id()), user, digest)

    def encode_docs(self, texts: Sequence[str], threads: int = 1) -> list[np.ndarray]:
        """Token ids of each text followed by EOS (the document separator), as int64 arrays."""
        ids = self._sp.encode(list(texts), num_threads=threads)
        return [np.asarray([*doc, self.eos_id], dtype=np.int64) for doc in ids]

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def decode(self, ids: Iterable[int]) -> str:
        return str(self._sp.decode([int(i) for i in ids]))


def iter_chunks(items: Sequence[str], size: int) -> Iterator[Sequence[str]]:
    """Consecutive slices of `items` of at most `size` elements."""
    for i in range(0, len(items), size):
        yield items[i:i + size]
