"""Data configuration: where training samples come from and how they are packed and mixed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from framework.errors import ConfigError


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    seq_len: int = 128
    """Tokens per training sequence (each sample holds seq_len + 1 tokens: inputs and shifted labels)."""
    kind: Literal["synthetic", "stdlib"] = "stdlib"
    """synthetic: seeded random tokens (engine tests, benchmarks); stdlib: the embedded corpus built from the
    running interpreter's standard library (code, prose, tests)."""
    cache_dir: str = ".cache/tessera"
    """Where built corpora, tokenizers and .bin/.idx files are cached between runs."""
    vocab_size: int = 4096
    """Tokenizer vocabulary trained for the embedded corpus."""
    weights: dict[str, float] = field(default_factory=lambda: {"code": 0.5, "prose": 0.3, "tests": 0.2})
    """Mixture weights by source (domain); normalized to sum to 1."""
    seed: int = 1234
    """Seed of the mixture order (independent of world size and workers)."""

    def validate(self) -> None:
        if self.seq_len < 2:
            raise ConfigError(f"data.seq_len={self.seq_len} must be >= 2; e.g. 128")
        if any(w < 0 for w in self.weights.values()) or not any(w > 0 for w in self.weights.values()):
            raise ConfigError(
                f"data.weights={self.weights} must be non-negative with at least one positive; "
                f"e.g. {{code: 0.5, prose: 0.3, tests: 0.2}}")
