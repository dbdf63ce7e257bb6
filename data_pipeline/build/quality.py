"""Model-based quality scoring: a fastText classifier (DCLM's `fasttext_oh_eli5.bin` format: labels `__label__hq`
/ `__label__cc`) scores each document with the probability of its positive label, or a Hugging Face
sequence-classification model run on CPU with the probability of one label (a regression head, as FineWeb-Edu's
classifier, gives its output); the `quality` filter keeps the documents at or above a threshold. `train_quality`
makes a fastText classifier from positive and negative example texts, as DCLM made its own (`tessera data
train-quality`).

A document is given to the classifier as one line (newlines to spaces, as DCLM does) of at most `max_chars`
characters. Scores depend only on the text and the model file, so they are the same whatever the ingest tasks;
the model's bytes are part of the ingest stamp (data_pipeline/build/invalidate.py). The bindings are optional:
`pip install 'tessera[quality]'` (fasttext-wheel, whose wheels need no compiler); their `predict` wrapper breaks
under numpy 2, so the C++ method it wraps is called directly.
"""

from __future__ import annotations

import functools
import math
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from framework.base.errors import ConfigError, DataError

POSITIVE, NEGATIVE = "__label__hq", "__label__cc"
"""DCLM's labels (its classifier's positive class is `hq`)."""


@dataclass(kw_only=True, frozen=True)
class QualityFilter:
    model: str | None = None
    """A fastText .bin classifier, or (kind hf) a local Hugging Face model folder; required when a source lists
    the `quality` filter."""
    kind: Literal["fasttext", "hf"] = "fasttext"
    label: str = POSITIVE
    """The label whose probability is the score (hf: a name of the model's `id2label`; ignored for a regression
    head of one output, whose output is the score)."""
    threshold: float | None = None
    """Documents scoring below are dropped (`quality.low_score`); None: 0.5, unless `top_fraction` is set."""
    top_fraction: float | None = None
    """Instead of a threshold: keep this fraction of each source's documents that pass its other filters, the
    highest-scoring, decided over the whole source once every ingest unit is scored (ties: the earlier document);
    the others are dropped as `quality.top_fraction`."""
    max_chars: int = 10_000
    """Characters of a document the classifier reads (its start)."""

    def validate(self) -> None:
        if self.threshold is not None and self.top_fraction is not None:
            raise ConfigError(f"filters.quality sets both threshold={self.threshold} and top_fraction="
                              f"{self.top_fraction}; keep by one of them: remove the other")
        if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
            raise ConfigError(f"filters.quality.threshold={self.threshold} must be a probability in [0, 1]")
        if self.top_fraction is not None and not 0.0 < self.top_fraction <= 1.0:
            raise ConfigError(f"filters.quality.top_fraction={self.top_fraction} must be in (0, 1] (e.g. 0.1 keeps "
                              f"the best-scoring tenth of each source)")
        if self.model is not None and not Path(self.model).exists():
            raise ConfigError(f"filters.quality.model={self.model!r} does not exist; give a fastText .bin "
                              f"(`tessera data train-quality` makes one) or, with kind: hf, a model folder")


def model_files(path: str) -> list[Path]:
    """The files a quality model is made of (a .bin; or a Hugging Face folder's files), for the ingest stamp."""
    p = Path(path)
    return sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]


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


def quality_filter(text: str, c: QualityFilter, scores: dict[str, float] | None = None
                   ) -> tuple[str | None, str | None]:
    """Score `text` (into `scores["quality"]` when given) and judge it by the threshold; with `top_fraction` every
    document passes here (the cut is made over the whole source: `top_fraction_cut`)."""
    if c.model is None:
        raise ConfigError("a source runs the quality filter but filters.quality.model is not set; give a fastText "
                          ".bin (`tessera data train-quality` makes one)")
    value = (hf_score(text, c.model, c.label, c.max_chars) if c.kind == "hf"
             else score(text, load_classifier(c.model), c.label, c.max_chars))
    if scores is not None:
        scores["quality"] = value
    if c.top_fraction is None and value < (0.5 if c.threshold is None else c.threshold):
        return None, "quality.low_score"
    return text, None


QUANTILES = (0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99)
"""The quantiles of a source's scores in the manifest (numpy's default, linear interpolation)."""


def top_fraction_cut(scores: list[float], fraction: float) -> tuple[list[bool], float | None]:
    """Which of a source's candidates (scores in document order) the top `fraction` keeps — the ceil(fraction x n)
    highest, an earlier document first among equal scores — and the lowest kept score (None: none kept)."""
    k = math.ceil(round(fraction * len(scores), 9))
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:k]
    keep = [False] * len(scores)
    for i in order:
        keep[i] = True
    return keep, (scores[order[-1]] if order else None)


def distribution(scores: list[float]) -> dict[str, Any]:
    """Count, mean, min, quantiles (`QUANTILES`) and max of scores, for the build report."""
    if not scores:
        return {"count": 0}
    a = np.asarray(scores, dtype=np.float64)
    qs = np.quantile(a, QUANTILES)
    return {"count": len(scores), "mean": float(a.mean()), "min": float(a.min()),
            **{f"p{round(100 * q)}": float(v) for q, v in zip(QUANTILES, qs, strict=True)}, "max": float(a.max())}


@functools.lru_cache(maxsize=1)
def _hf_classifier(path: str) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.set_num_threads(1)  # one per ingest worker: the workers are the parallelism
    return AutoTokenizer.from_pretrained(path), AutoModelForSequenceClassification.from_pretrained(path).eval()


def hf_score(text: str, path: str, label: str, max_chars: int = 10_000) -> float:
    """A Hugging Face sequence classifier's probability of `label` for `text` (its first 512 tokens), or the output
    of a one-output regression head."""
    import torch

    tok, model = _hf_classifier(path)
    with torch.inference_mode():
        logits = model(**tok(text[:max_chars], truncation=True, max_length=512, return_tensors="pt")).logits[0]
    if logits.numel() == 1:
        return float(logits[0])
    ids = {name: int(i) for i, name in model.config.id2label.items()}
    if label not in ids:
        raise ConfigError(f"filters.quality.label={label!r} is not a label of {path} (labels: {sorted(ids)})")
    return float(torch.softmax(logits.float(), dim=-1)[ids[label]])


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
