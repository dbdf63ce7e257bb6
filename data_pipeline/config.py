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
class OnlineMixing:
    """`data.mixing: online`: every `interval` optimizer steps the weights move by DoReMi's exponentiated-gradient
    rule on each domain's excess held-out loss (Xie et al. 2023, arXiv:2305.10429; docs/DATA.md, online mixing)."""

    interval: int = 100
    """Optimizer steps between weight updates (K); the first update follows step K."""
    step_size: float = 1.0
    """eta of the rule: w <- w * exp(eta * excess), renormalized (DoReMi's default 1)."""
    smoothing: float = 1e-3
    """c: the new weights are (1 - c) * rule + c * uniform over the mixed domains (DoReMi's default 1e-3)."""
    eval_samples: int = 16
    """Held-out samples per domain scored at each update (the first ones of its validation split, the same set at
    every world size); a multiple of train.micro_batch_size x data-parallel size."""
    reference: dict[str, float] = field(default_factory=dict)
    """Per-domain held-out loss of a reference model (DoReMi's reference run on the prior mixture, e.g. an ablation
    proxy's val_loss/<domain>); excess = max(loss - reference, 0). A domain left out has reference 0 (its loss
    itself drives the rule)."""
    round_to: float = 1e-3
    """Losses are rounded to this grid before the update, so runs whose losses differ only by the summation order
    of another world size compute the same weights."""

    def validate(self) -> None:
        if self.interval < 1 or self.eval_samples < 1:
            raise ConfigError(f"data.online.interval={self.interval} and data.online.eval_samples="
                              f"{self.eval_samples} must be >= 1; e.g. interval 100, eval_samples 16")
        if not self.step_size > 0 or not self.round_to > 0:
            raise ConfigError(f"data.online.step_size={self.step_size} and data.online.round_to={self.round_to} "
                              f"must be > 0; e.g. 1.0 and 1e-3")
        if not 0 <= self.smoothing < 1:
            raise ConfigError(f"data.online.smoothing={self.smoothing} must be in [0, 1); e.g. 1e-3")
        if any(not 0 <= v < float("inf") for v in self.reference.values()):
            raise ConfigError(f"data.online.reference={self.reference} must hold finite losses >= 0")


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
    mixing: Literal["static", "online"] = "static"
    """static: `weights` (and `schedule`) as given; online: the weights adapt during the run from per-domain
    held-out losses (`online`)."""
    online: OnlineMixing = field(default_factory=OnlineMixing)
    """Settings of `mixing: online`."""
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
        if self.mixing == "online":
            self._validate_online()

    def _validate_online(self) -> None:
        mixed = sorted(n for n, w in self.weights.items() if w > 0)
        if self.kind == "synthetic" or len(mixed) < 2:
            raise ConfigError(f"data.mixing=online needs two or more sources with positive data.weights (now "
                              f"{mixed}, data.kind={self.kind}); use data.kind=stdlib or build, or data.mixing=static")
        for key, value in (("schedule", self.schedule), ("max_epochs", self.max_epochs)):
            if value:
                raise ConfigError(f"data.mixing=online sets the weights itself and is not combined with data.{key} "
                                  f"(now {value}); remove data.{key} or set data.mixing=static")
        unknown = sorted(set(self.online.reference) - set(mixed))
        if unknown:
            raise ConfigError(f"data.online.reference names {unknown}, which are not mixed sources {mixed}; "
                              f"give references for those sources only")
