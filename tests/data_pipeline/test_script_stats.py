"""The tokenizer on real translated text (tests/fixtures/multilingual): character_coverage chosen by the sample's
scripts, the vocabulary error naming the size that works, and tokens per character by language in the build's
manifest and `data stats`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sentencepiece as spm

from data_pipeline.build.config import BuildConfig, SourceConfig, TokenizerConfig
from data_pipeline.build.normalize import NormalizeConfig, normalize
from data_pipeline.build.run import run_build
from data_pipeline.cli import format_stats
from data_pipeline.script_stats import choose_character_coverage, language_of
from data_pipeline.tokenizer import train_sentencepiece
from framework.base.errors import ConfigError, DataError

FIXTURE = Path(__file__).parents[1] / "fixtures" / "multilingual" / "texts.jsonl"
ROWS = [json.loads(line) for line in FIXTURE.read_text(encoding="utf-8").splitlines()]
CJK = [r["text"] for r in ROWS if r["lang"] in ("zh", "ja")]
RUSSIAN = [r["text"] for r in ROWS if r["lang"] == "ru"]
# The fixture's languages (from the catalogue each text came from) and the script that tells them.
NAMES = {"zh": "Chinese", "ja": "Japanese", "th": "Thai", "ko": "Korean", "ru": "Cyrillic", "ar": "Arabic"}


def test_languages_are_told_by_script_as_the_catalogues_label_them() -> None:
    for r in ROWS:
        if r["kind"] == "prose":
            assert language_of(r["text"]) == NAMES[r["lang"]], r["text"][:60]
    assert language_of("The tokenizer is trained on a sample.") == "Latin"
    assert language_of("1234 -- ()") == "other"


def test_coverage_is_chosen_by_the_scripts_and_holds_in_the_trained_model(tmp_path: Path) -> None:
    assert choose_character_coverage(CJK, 4096)[0] == 0.9995
    assert choose_character_coverage(RUSSIAN, 4096)[0] == 1.0
    chinese = [r["text"] for r in ROWS if r["lang"] == "zh"]
    assert choose_character_coverage(RUSSIAN + chinese[:1], 4096)[0] == 0.9995  # 2.9% Chinese
    assert choose_character_coverage([*RUSSIAN, chinese[0][:30]], 4096)[0] == 1.0  # 0.2%: a stray quotation
    # 114 distinct characters: 1.0 while they take at most a quarter of the pieces beside the 261 byte and special
    assert choose_character_coverage(RUSSIAN, 261 + 4 * 114)[0] == 1.0
    assert choose_character_coverage(RUSSIAN, 260 + 4 * 114)[0] == 0.9995
    model = tmp_path / "ru.model"

    def byte_tokens(coverage: float | None) -> int:
        train_sentencepiece(RUSSIAN, model, vocab_size=1000, character_coverage=coverage)
        sp = spm.SentencePieceProcessor(model_file=str(model))
        return sum(sp.is_byte(i) for text in RUSSIAN for i in sp.encode(text))

    assert byte_tokens(None) == 0  # 1.0: every character of the sample has a piece
    assert byte_tokens(0.9995) > 0  # the rarest fall back to bytes


def test_the_vocabulary_error_names_the_size_that_works(tmp_path: Path) -> None:
    model = tmp_path / "cjk.model"
    with pytest.raises(DataError) as err:
        train_sentencepiece(CJK, model, vocab_size=1000)
    msg = str(err.value)
    assert "lower vocab_size" not in msg and "character_coverage" in msg and "1000" in msg
    need = int(msg.split("to at least ")[1].split(",")[0])
    train_sentencepiece(CJK, model, vocab_size=need)  # the number given is enough
    with pytest.raises(DataError, match=f"the {need} pieces"):
        train_sentencepiece(CJK, model, vocab_size=need - 1)  # and is the least
    with pytest.raises(ConfigError, match="character_coverage"):
        TokenizerConfig(character_coverage=1.5).validate()


def test_manifest_and_stats_give_tokens_per_character_by_language(tmp_path: Path) -> None:
    by_lang: dict[str, list[str]] = {}
    for r in ROWS:  # what ingest keeps: trailing whitespace trimmed
        by_lang.setdefault(r["lang"], []).append(normalize(r["text"], NormalizeConfig()))
    sources = []
    for lang in ("zh", "th", "ru"):
        path = tmp_path / f"{lang}.jsonl"
        path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in by_lang[lang]))
        sources.append(SourceConfig(name=lang, path=str(path), profile="docs"))
    cfg = BuildConfig(output_dir=str(tmp_path / "out"), sources=sources, shard_docs=16, workers=1,
                      tokenizer=TokenizerConfig(vocab_size=2000, sample_chars=200_000))
    manifest = run_build(cfg)
    langs = manifest["tokenizer"]["languages"]
    assert set(langs) == {"Chinese", "Thai", "Cyrillic"}
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "out" / "tokenizer.model"))
    for lang, name in (("zh", "Chinese"), ("th", "Thai"), ("ru", "Cyrillic")):
        assert langs[name]["documents"] == len(by_lang[lang])  # the whole corpus fits in the sample here
        assert langs[name]["characters"] == sum(map(len, by_lang[lang]))
        assert langs[name]["tokens"] == sum(len(sp.encode(t)) for t in by_lang[lang])
    table = format_stats(manifest)
    assert "tokens/char" in table and "Chinese" in table
