"""Data configuration (`cfg.data`): where training samples come from and how they are packed and mixed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from framework.base.errors import ConfigError


@dataclass(kw_only=True, frozen=True)
class MixturePhase:
    """From optimizer step `start_step` on, the mixture uses `weights` (e.g. an annealing phase)."""

    start_step: int
    weights: dict[str, float]


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    seq_len: int = 128
    """Tokens per training sequence (each sample holds seq_len + 1 tokens: inputs and shifted labels)."""
    kind: Literal["synthetic", "stdlib", "build"] = "stdlib"
    """synthetic: seeded random tokens (engine tests, benchmarks); stdlib: the embedded corpus built from the
    running interpreter's standard library (code, prose, tests); build: a directory written by
    `tessera data build` (`build_dir`)."""
    cache_dir: str = ".cache/tessera"
    """Where built corpora, tokenizers and .bin/.idx files are cached between runs."""
    build_dir: str | None = None
    """kind=build: the output directory of `tessera data build` (holds manifest.json)."""
    vocab_size: int = 4096
    """Tokenizer vocabulary trained for the embedded corpus (kind=stdlib) or of the synthetic tokens. In a
    training config it follows model.vocab_size when not given (framework/config); setting it is deprecated."""
    tokenizer_type: Literal["bpe", "unigram"] = "bpe"
    tokenizer_sample_chars: int = 3_000_000
    """Characters of text sampled across domains to train the stdlib tokenizer (keeps the build fast)."""
    weights: dict[str, float] = field(default_factory=lambda: {"code": 0.5, "prose": 0.3, "tests": 0.2})
    """Mixture weights by source (domain); normalized to sum to 1. A source left out gets weight 0."""
    schedule: list[MixturePhase] = field(default_factory=list)
    """Later mixture phases: weights that take over at given optimizer steps (needs the global batch size)."""
    max_epochs: dict[str, float] = field(default_factory=dict)
    """Per-source cap on epochs read in one pass of the mixture (upsampling beyond it is an error)."""
    warn_epochs: float = 4.0
    """At training start, warn for a source read more than this many times in one pass of the mixture."""
    num_samples: int | None = None
    """Samples in one pass of the training mixture; None: as many as the training splits hold."""
    val_fraction: float = 0.02
    """Share of each source's documents held out for validation, chosen by document hash (mixture-independent)."""
    seed: int = 1234
    """Seed of the mixture order (independent of world size and workers)."""
    wait_timeout_s: float = 1800.0
    """How long non-builder ranks wait for the builder's outputs before failing."""
    document_mask: bool = False
    """Attend only within each document of a packed row (block-causal mask from the EOD tokens of the inputs);
    costs an O(seq_len^2) mask per row and takes SDPA off its flash kernel (docs/DATA.md)."""
    reset_position_ids: bool = False
    """Restart rotary positions at 0 after every EOD token (Megatron's reset_position_ids)."""
    eod_id: int | None = None
    """Token id that ends each document, for document_mask / reset_position_ids; None: the tokenizer's EOS."""

    def validate(self) -> None:
        if self.seq_len < 2:
            raise ConfigError(f"data.seq_len={self.seq_len} must be >= 2; e.g. 128")
        for where, weights in [("data.weights", self.weights)] + [
                (f"data.schedule[{i}].weights", p.weights) for i, p in enumerate(self.schedule)]:
            if any(w < 0 for w in weights.values()) or not any(w > 0 for w in weights.values()):
                raise ConfigError(
                    f"{where}={weights} must be non-negative with at least one positive; "
                    f"e.g. {{code: 0.5, prose: 0.3, tests: 0.2}}")
        starts = [p.start_step for p in self.schedule]
        if any(s <= 0 for s in starts) or starts != sorted(set(starts)):
            raise ConfigError(f"data.schedule start_step values {starts} must be positive and increasing; the "
                              f"phase from step 0 uses data.weights")
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(f"data.val_fraction={self.val_fraction} must be in [0, 1); e.g. 0.02")
        if self.kind == "build" and not self.build_dir:
            raise ConfigError("data.kind='build' needs data.build_dir (the output of `tessera data build`)")
        if self.kind == "stdlib" and self.vocab_size < 300:
            raise ConfigError(f"data.vocab_size={self.vocab_size} must be >= 300 (256 byte-fallback pieces plus "
                              f"specials); e.g. 4096")
        if self.vocab_size < 2:
            raise ConfigError(f"data.vocab_size={self.vocab_size} must be >= 2; e.g. 4096")
        if self.num_samples is not None and self.num_samples < 1:
            raise ConfigError(f"data.num_samples={self.num_samples} must be >= 1 or null")
        if self.eod_id is not None and self.eod_id < 0:
            raise ConfigError(f"data.eod_id={self.eod_id} must be a token id >= 0, or null for the tokenizer's EOS")
        if any(c <= 0 for c in self.max_epochs.values()):
            raise ConfigError(f"data.max_epochs={self.max_epochs} must be positive; e.g. {{prose: 4}}")
