"""Model-based quality scoring: a fastText classifier (DCLM's `fasttext_oh_eli5.bin` format: labels `__label__hq`
/ `__label__cc`) scores each document with the probability of its positive label; the `quality` filter keeps the
documents at or above a threshold. `train_quality` makes such a classifier from positive and negative example
texts, as DCLM and FineWeb-Edu made theirs (`tessera data train-quality`).

A document is given to the classifier as one line (newlines to spaces, as DCLM does) of at most `max_chars`
characters. Scores depend only on the text and the model file, so they are the same whatever the ingest tasks;
the model's bytes are part of the ingest stamp (data_pipeline/invalidate.py). The bindings are optional:
`pip install 'tessera[quality]'` (fasttext-wheel, whose wheels need no compiler); their `predict` wrapper breaks
under numpy 2, so the C++ method it wraps is called directly.
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from framework.base.errors import ConfigError, DataError

POSITIVE, NEGATIVE = "__label__hq", "__label__cc"
"""DCLM's labels (its classifier's positive class is `hq`)."""


@dataclass(kw_only=True, frozen=True)
class QualityFilter:
    model: str | None = None
    """A fastText .bin classifier; required when a source lists the `quality` filter."""
    label: str = POSITIVE
    """The label whose probability is the score."""
    threshold: float = 0.5
    """Documents scoring below are dropped (`quality.low_score`)."""
    max_chars: int = 10_000
    """Characters of a document the classifier reads (its start)."""

    def validate(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ConfigError(f"filters.quality.threshold={self.threshold} must be a probability in [0, 1]")
        if self.model is not None and not Path(self.model).is_file():
            raise ConfigError(f"filters.quality.model={self.model!r} is not a file; give a fastText .bin "
                              f"(`tessera data train-quality` makes one)")


def _fasttext() -> Any:
    try:
        import fasttext
    except ImportError as err:
        raise ConfigError("the quality filter needs fastText's bindings: pip install 'tessera[quality]' "
                          "(fasttext-wheel)") from err
    return fasttext


@functools.lru_cache(maxsize=2)
def load_classifier(path: str) -> Any:
    """The fastText model at `path`, loaded once per process."""
    try:
        return _fasttext().FastText._FastText(model_path=path)  # load_model's own wrapper, without its warning
    except ValueError as err:
        raise DataError(f"{path} does not load as a fastText model ({err})") from err


def score(text: str, model: Any, label: str = POSITIVE, max_chars: int = 10_000) -> float:
    """The probability of `label` for `text` (0.0 when the model does not predict it at all)."""
    line = " ".join(text[:max_chars].split())
    for prob, lab in model.f.predict(line, -1, 0.0, "replace"):
        if lab == label:
            return float(prob)
    return 0.0


def quality_filter(text: str, c: QualityFilter) -> tuple[str | None, str | None]:
    if c.model is None:
        raise ConfigError("a source runs the quality filter but filters.quality.model is not set; give a fastText "
                          ".bin (`tessera data train-quality` makes one)")
    if score(text, load_classifier(c.model), c.label, c.max_chars) < c.threshold:
        return None, "quality.low_score"
    return text, None


def train_quality(positive: Iterable[str], negative: Iterable[str], out: str | Path, *, epoch: int = 5,
                  lr: float = 0.1, dim: int = 64, word_ngrams: int = 2, seed: int = 0, max_chars: int = 10_000
                  ) -> Path:
    """Train a fastText classifier (labels `POSITIVE` / `NEGATIVE`) on example texts, one thread (the same model
    every run), and write it to `out` atomically."""
    ft = _fasttext()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    n = {POSITIVE: 0, NEGATIVE: 0}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "train.txt"
        with open(data, "w", encoding="utf-8") as f:
            for label, texts in ((POSITIVE, positive), (NEGATIVE, negative)):
                for t in texts:
                    line = " ".join(t[:max_chars].split())
                    if line:
                        f.write(f"{label} {line}\n")
                        n[label] += 1
        if not all(n.values()):
            raise DataError(f"training a quality classifier needs positive and negative examples; got {n}")
        model = ft.train_supervised(str(data), epoch=epoch, lr=lr, dim=dim, wordNgrams=word_ngrams, thread=1, seed=seed,
                                    verbose=0, minCount=1)
        part = out.with_name(out.name + ".tmp")
        model.save_model(str(part))
        os.replace(part, out)
    return out
