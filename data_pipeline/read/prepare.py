"""`prepare_data`: from `cfg.data` to the trainer's samples (a weighted training mixture and per-source val sets).

kind=synthetic needs no files. kind=stdlib builds (once, cached under `cfg.cache_dir`) the embedded corpus from
the running interpreter's standard library; kind=build reads a directory written by `tessera data build`.
Either way the build directory holds one Megatron .bin/.idx per source, a `<source>.hash.npy` of document
hashes (for the held-out split) and `manifest.json`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data_pipeline.build.cache import MANIFEST, build_once, config_key
from data_pipeline.build.progress import log
from data_pipeline.config import DataConfig
from data_pipeline.indexed import IndexedTokens
from data_pipeline.read.loader import Samples, SyntheticSamples
from data_pipeline.read.mixing import MixtureSamples
from data_pipeline.read.packing import PackedSource
from framework.base.errors import ConfigError, DataError

_SYNTHETIC_VAL_SAMPLES = 64


@dataclass(frozen=True)
class PreparedData:
    """Everything the trainer needs from the data side."""

    train: Samples
    """The weighted mixture of the training splits, packed."""
    val: dict[str, Samples]
    """Per-source held-out samples."""
    vocab_size: int
    eos_id: int
    """The end-of-document token; -1 when the build's tokenizer names none (data.document_mask then refuses)."""
    tokenizer_path: str | None
    fingerprint: str
    """Identifies data + mixture; checkpoints compare it to refuse resuming on different data."""
    build_dir: str | None = None


def val_mask(hashes: np.ndarray, fraction: float) -> np.ndarray:
    """Documents held out for validation: a fixed function of each document's content hash.

    The same documents are held out whatever the mixture weights or seed, so ablations compare like with like.
    """
    # The top 53 bits of the hash as a uniform number in [0, 1).
    u = (np.asarray(hashes, dtype=np.uint64) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return u < fraction


def read_manifest(build_dir: str | Path) -> dict[str, Any]:
    path = Path(build_dir) / MANIFEST
    if not path.is_file():
        raise DataError(f"{path} does not exist; {build_dir} is not a finished data build — run "
                        f"`tessera data build CONFIG` (or point data.build_dir at its output)")
    manifest: dict[str, Any] = json.loads(path.read_text())
    return manifest


def check_vocab(tokenizer_vocab: int, model_vocab: int) -> None:
    """The tokenizer's ids must fit the model's embedding: ConfigError naming the fix otherwise."""
    if tokenizer_vocab > model_vocab:
        raise ConfigError(f"model.vocab_size={model_vocab} is smaller than the tokenizer's vocabulary "
                          f"({tokenizer_vocab}); set model.vocab_size={tokenizer_vocab} or larger")


def check_build_vocab(cfg: DataConfig, model_vocab: int) -> None:
    """Before any rank starts or any mixture is drawn: a finished build's tokenizer (data.kind=build, from its
    manifest) must fit model.vocab_size. Other kinds are checked once prepared."""
    if cfg.kind == "build" and cfg.build_dir:
        check_vocab(int(read_manifest(cfg.build_dir)["tokenizer"]["vocab_size"]), model_vocab)


BatchHistory = Sequence[tuple[int, int, int]]
"""`(from_step, at_sample, global_batch_size)` per batch size a run has trained with, the first `(0, 0, gbs)`: a
resume with a new `train.global_batch_size` appends `(resumed step, consumed samples, new gbs)`."""


def sample_at_step(step: int, history: BatchHistory) -> int:
    """The global sample position at the start of optimizer step `step` (0-based) under `history`."""
    from_step, at_sample, gbs = max((h for h in history if h[0] <= step), key=lambda h: h[0])
    return at_sample + (step - from_step) * gbs


def _phases(cfg: DataConfig, global_batch_size: int | None,
            batch_history: BatchHistory | None = None) -> list[tuple[int, dict[str, float]]]:
    phases: list[tuple[int, dict[str, float]]] = [(0, dict(cfg.weights))]
    if cfg.schedule and global_batch_size is None and not batch_history:
        raise ConfigError("data.schedule changes weights at optimizer steps, so prepare_data needs "
                          "global_batch_size=train.global_batch_size to place them; pass it")
    history = batch_history or [(0, 0, int(global_batch_size or 0))]
    for p in cfg.schedule:
        phases.append((sample_at_step(p.start_step, history), dict(p.weights)))
    return phases


def mixture_lines(train: dict[str, PackedSource], val: dict[str, Samples], phases: list[tuple[int, dict[str, float]]],
                  length: int, warn_epochs: float) -> list[str]:
    """One line per source: samples drawn in one pass of the mixture, how many epochs of the source that is,
    held-out documents; a warning line for a source read more than `warn_epochs` times (silent upsampling)."""
    drawn = dict.fromkeys(train, 0.0)
    bounds = [p[0] for p in phases[1:]] + [length]
    for (start, weights), end in zip(phases, bounds, strict=True):
        total = sum(weights.values()) or 1.0
        for name, w in weights.items():
            drawn[name] += max(0, min(end, length) - start) * w / total
    lines = []
    for name in sorted(train):
        epochs = drawn[name] / max(1, len(train[name]))
        held = len(val[name]) if name in val else 0
        lines.append(f"mixture {name}: {drawn[name]:,.0f} of {length:,} samples per pass, {epochs:.2f} epochs of "
                     f"its {len(train[name]):,} training samples; {held:,} held-out samples"
                     f"{'' if held else ' (not evaluated)'}")
        if epochs > warn_epochs:
            lines.append(f"WARNING: source {name} is read {epochs:.1f} times per pass (above data.warn_epochs="
                         f"{warn_epochs}); lower its weight, set data.num_samples, or cap it with data.max_epochs")
    return lines


def load_build(build_dir: str | Path, cfg: DataConfig, global_batch_size: int | None = None,
               batch_history: BatchHistory | None = None) -> PreparedData:
    """Open a finished build and arrange its sources into the training mixture and validation sets.

    `data.schedule` phases start at optimizer steps, placed as samples by `batch_history` (default: one batch size,
    `global_batch_size`, from step 0).
    """
    build_dir = Path(build_dir)
    manifest = read_manifest(build_dir)
    train: dict[str, PackedSource] = {}
    val: dict[str, Samples] = {}
    for name in sorted(manifest["sources"]):
        tokens = IndexedTokens(build_dir / name)
        hashes = np.load(build_dir / f"{name}.hash.npy")
        if len(hashes) != len(tokens):
            raise DataError(f"{build_dir}/{name}: {len(hashes)} document hashes for {len(tokens)} documents; "
                            f"the build is inconsistent — rebuild it")
        held = val_mask(hashes, cfg.val_fraction)
        train[name] = PackedSource(tokens, np.flatnonzero(~held), seq_len=cfg.seq_len, seed=cfg.seed, name=name)
        if held.any():
            val[name] = PackedSource(tokens, np.flatnonzero(held), seq_len=cfg.seq_len, seed=cfg.seed,
                                     name=name, shuffle=False)
    phases = _phases(cfg, global_batch_size, batch_history)
    for start, weights in phases:
        unknown = sorted(set(weights) - set(train))
        if unknown:
            raise DataError(f"data weights (phase from sample {start}) name sources {unknown} that the build "
                            f"{build_dir} does not have; known sources: {sorted(train)}")
    used = [n for n in train if cfg.weights.get(n, 0) > 0]
    length = cfg.num_samples or sum(len(train[n]) for n in used)
    mixture = MixtureSamples(train, phases, length, cfg.max_epochs)
    for line in mixture_lines(train, val, phases, length, cfg.warn_epochs):
        log(line)
    tok = manifest["tokenizer"]
    fingerprint = hashlib.sha256(json.dumps({
        "data": manifest["fingerprint"], "seq_len": cfg.seq_len, "seed": cfg.seed, "phases": phases,
        "val_fraction": cfg.val_fraction, "length": length,
        # online mixing's settings decide every later phase; a static run's fingerprint is what it always was
        **({"online": dataclasses.asdict(cfg.online)} if cfg.mixing == "online" else {})},
        sort_keys=True).encode()).hexdigest()
    return PreparedData(train=mixture, val={k: v for k, v in val.items() if len(v)},
                        vocab_size=int(tok["vocab_size"]), eos_id=int(tok.get("eos_id", -1)),
                        tokenizer_path=str(build_dir / Path(tok["path"]).name), fingerprint=fingerprint,
                        build_dir=str(build_dir))


def _synthetic(cfg: DataConfig) -> PreparedData:
    train = SyntheticSamples(cfg.vocab_size, cfg.seq_len, cfg.seed, length=cfg.num_samples or (1 << 30))
    # A disjoint seed stream for validation so it never repeats a training sample.
    val: dict[str, Samples] = {"synthetic": SyntheticSamples(cfg.vocab_size, cfg.seq_len, cfg.seed + 0x5EED,
                                         length=_SYNTHETIC_VAL_SAMPLES)}
    fp = hashlib.sha256(f"synthetic:{cfg.vocab_size}:{cfg.seq_len}:{cfg.seed}:{cfg.num_samples}".encode())
    return PreparedData(train=train, val=val, vocab_size=cfg.vocab_size, eos_id=cfg.vocab_size - 1,
                        tokenizer_path=None, fingerprint=fp.hexdigest())


def stdlib_build_dir(cfg: DataConfig) -> Path:
    """Cache directory of the stdlib build for `cfg` (keyed by build settings and the interpreter)."""
    from data_pipeline.build.stdlib import stdlib_build_key

    return Path(cfg.cache_dir).resolve() / f"stdlib-{config_key(stdlib_build_key(cfg))}"


def tokenizer_path(cfg: DataConfig) -> Path | None:
    """The tokenizer file of the build `cfg` reads (None for synthetic data), from the build's manifest alone:
    nothing is built, opened or waited for.

    Raises:
        DataError: the build (for kind=stdlib: its cache entry) has no manifest.
    """
    if cfg.kind == "synthetic":
        return None
    build_dir = stdlib_build_dir(cfg) if cfg.kind == "stdlib" else Path(str(cfg.build_dir))
    return build_dir / Path(read_manifest(build_dir)["tokenizer"]["path"]).name


def prepare_data(cfg: DataConfig, *, is_builder: bool = True, global_batch_size: int | None = None,
                 batch_history: BatchHistory | None = None) -> PreparedData:
    """Build (or reuse, or wait for) the data `cfg` describes and return the trainer's samples.

    Args:
        cfg: The data section of the run config.
        is_builder: True on exactly one process per node-shared cache (rank 0); the others wait for its
            outputs instead of building.
        global_batch_size: train.global_batch_size; needed only when `cfg.schedule` has later phases.
        batch_history: The batch sizes a resumed run trained with (`BatchHistory`), so that a phase keeps the
            sample it started at under an earlier batch size; default one batch size from step 0.
    """
    cfg.validate()
    if cfg.kind == "synthetic":
        return _synthetic(cfg)
    if cfg.kind == "stdlib":
        from data_pipeline.build.stdlib import build_stdlib

        final = stdlib_build_dir(cfg)
        build_once(final, lambda tmp: build_stdlib(tmp, cfg), is_builder=is_builder, timeout_s=cfg.wait_timeout_s)
        return load_build(final, cfg, global_batch_size, batch_history)
    assert cfg.build_dir is not None  # validate() guarantees it
    return load_build(cfg.build_dir, cfg, global_batch_size, batch_history)
