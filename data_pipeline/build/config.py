"""Configuration of an offline data build (`tessera data build CONFIG`): sources and every stage's settings."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from data_pipeline.build.dedup import DedupConfig
from data_pipeline.build.filters import PROFILES, FiltersConfig, resolve_filters
from data_pipeline.build.normalize import NormalizeConfig
from framework.base.errors import ConfigError
from framework.base.yaml_config import apply_overrides, from_dict, load_yaml, validate_tree


@dataclass(kw_only=True, frozen=True)
class SourceConfig:
    name: str
    """Source name: names the output `<name>.bin/.idx` and the mixture weight key."""
    path: str
    """A file or directory (relative paths are relative to the working directory of the build)."""
    format: Literal["auto", "jsonl", "parquet", "hf", "text"] = "auto"
    """auto: from what is there — a file by its extension, a directory by its files' (see ingest.detect_format)."""
    text_field: str = "text"
    glob: str = "*"
    """Text trees: which files are documents (`*.py` also matches `x.py.gz`)."""
    hf_builder: str | None = None
    """Read the files through `datasets.load_dataset(hf_builder, data_files=path)` (e.g. json, parquet)."""
    split: str = "train"
    """Hugging Face datasets: the split to read (a saved DatasetDict's other splits are never mixed in)."""
    encoding_fallback: str | None = None
    """Text trees: the codec for files that are not UTF-8 (e.g. latin-1), counted per source; None: malformed."""
    profile: Literal["web", "docs", "code", "minimal"] = "web"
    """Which filters run when `filters` is not given: web (Gopher, C4, FineWeb: web pages), docs (hard-wrapped
    or technical prose: READMEs, man pages, RST, changelogs), code, minimal (length only)."""
    filters: list[str] | None = None
    normalize: NormalizeConfig | None = None
    """This source's normalization; None: the build's `normalize`, whose boilerplate removal applies only to
    web-profile sources (never to code, docs or minimal unless the source's own `normalize` asks for it)."""
    priority: int = 0
    """Duplicates across sources keep the copy in the highest-priority source."""

    def is_web(self) -> bool:
        return self.profile == "web" and (self.filters is None or "code" not in self.filters)

    def validate(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"sources[].name={self.name!r} must be a non-empty name of letters, digits, - or _")
        resolve_filters(self.filters, self.profile)


@dataclass(kw_only=True, frozen=True)
class TokenizerConfig:
    model: str | None = None
    """An existing tokenizer instead of training one: a sentencepiece .model, a Hugging Face tokenizer.json
    (its tokenizer_config.json beside it names EOS/BOS/pad), or a tiktoken-format BPE file (converted)."""
    vocab_size: int = 4096
    type: Literal["bpe", "unigram", "hf_bpe"] = "bpe"
    """Training: sentencepiece bpe or unigram, or hf_bpe (a byte-level BPE trained with HF tokenizers)."""
    sample_chars: int = 3_000_000
    """Characters sampled across sources (in proportion to their kept text) to train on."""
    pattern: str | None = None
    """tiktoken files: the pre-tokenizer regex (None: cl100k_base's, which Llama 3 uses too)."""
    special_tokens: list[str] = field(default_factory=lambda: ["<|endoftext|>"])
    """tiktoken files and hf_bpe: special tokens, given the ids after the vocabulary's."""
    eos_token: str | None = None
    """tiktoken files and hf_bpe: the end-of-document token (None: the first special token)."""
    bos_token: str | None = None
    threads: int = 2
    """Sentencepiece training threads. Its trained model depends on the thread count (1, 2 and 4 threads give three
    different models, each repeatable), so this is a tokenizer setting — part of the tokenizer's stamp, changing it
    retrains — and never the build's `workers`: the same config trains the same bytes whatever the parallelism."""
    character_coverage: float | None = None
    """Sentencepiece: share of the sample's characters given pieces of their own, the rest byte fallback. None:
    0.9995 when the sample is at least 1% Chinese, Japanese or Korean (or its distinct characters would take over a
    quarter of the vocabulary), else 1.0 (data_pipeline/script_stats.py)."""

    def validate(self) -> None:
        if self.character_coverage is not None and not 0.9 <= self.character_coverage <= 1.0:
            raise ConfigError(f"tokenizer.character_coverage={self.character_coverage} must be in [0.9, 1] (0.9995 "
                              f"for Chinese or Japanese, 1.0 for alphabetic scripts) or null to choose by the sample")
        if self.threads < 1:
            raise ConfigError(f"tokenizer.threads={self.threads} must be >= 1 (sentencepiece training threads)")
        for name in (self.eos_token, self.bos_token):
            if name is not None and name not in self.special_tokens:
                raise ConfigError(f"tokenizer eos_token/bos_token {name!r} is not in tokenizer.special_tokens "
                                  f"{self.special_tokens}; add it there")


@dataclass(kw_only=True, frozen=True)
class BuildConfig:
    output_dir: str
    """Where the build goes: <source>.bin/.idx/.hash.npy, tokenizer.model, manifest.json, work/ (stages)."""
    sources: list[SourceConfig]
    normalize: NormalizeConfig = field(default_factory=NormalizeConfig)
    filters: FiltersConfig = field(default_factory=FiltersConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    workers: int = 2
    """Worker processes for filtering, signatures and tokenization; no output byte depends on it."""
    shard_docs: int = 2000
    """Documents per shard (the unit of work, resumption and SLURM array tasks)."""
    unit_bytes: int = 1 << 27
    """Ingest units: a jsonl file is read as byte ranges of this size (each line in the range it starts in), a
    parquet file as runs of row groups and a saved HF dataset as row ranges of about this size, so one large file
    splits across tasks; compressed files cannot be read from an offset and are one unit each."""
    merge_bytes: int = 1 << 30
    """Merge units: runs of one source's token shards holding about this many bytes of tokens, concatenated into
    its .bin/.idx by one task (data_pipeline/build/merge.py). No output byte depends on it, nor does a task's memory
    (one shard's index at a time); its files are laid out by it, so changing it redoes the merge."""
    rejects: bool = True
    """Write malformed records with their reason to work/<source>/rejects.jsonl."""
    seed: int = 0

    def source_normalize(self, src: SourceConfig) -> NormalizeConfig:
        """The normalization a source gets: its own, else the build's (boilerplate removal for web sources only)."""
        if src.normalize is not None:
            return src.normalize
        if self.normalize.boilerplate and not src.is_web():
            return replace(self.normalize, boilerplate=False)
        return self.normalize

    def validate(self) -> None:
        names = [s.name for s in self.sources]
        if not names:
            raise ConfigError("sources is empty; list at least one source (name, path)")
        if len(set(names)) != len(names):
            raise ConfigError(f"sources names {names} repeat; give every source its own name")
        if self.workers < 1 or self.shard_docs < 1 or self.unit_bytes < 1 or self.merge_bytes < 1:
            raise ConfigError(f"workers={self.workers}, shard_docs={self.shard_docs}, unit_bytes={self.unit_bytes} and "
                              f"merge_bytes={self.merge_bytes} must be >= 1")


def load_build_config(path: str | Path, overrides: list[str] | None = None) -> BuildConfig:
    """Read a build YAML strictly (paths in it are relative to the working directory)."""
    cfg = from_dict(BuildConfig, apply_overrides(load_yaml(path), overrides or []))
    validate_tree(cfg)
    return cfg


__all__ = ["PROFILES", "BuildConfig", "SourceConfig", "TokenizerConfig", "load_build_config"]
