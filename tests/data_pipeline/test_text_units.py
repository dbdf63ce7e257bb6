"""Language-aware text units on real translated text (tests/fixtures/multilingual: the machine's gettext
catalogues in Chinese, Japanese, Thai, Korean, Russian and Arabic): the units against Unicode's own character
names, the docs profile's characters kept, near-copy recall and precision per script, and mixed-script pages."""

from __future__ import annotations

import json
import random
import re
import unicodedata
from pathlib import Path

import numpy as np
import pytest

from bench.dedup_eval import replace_letters
from data_pipeline import text_units
from data_pipeline.build.config import BuildConfig, SourceConfig
from data_pipeline.build.dedup import near_dedup
from data_pipeline.build.filters import FiltersConfig, apply_filters, resolve_filters
from data_pipeline.build.invalidate import stage_keys
from data_pipeline.build.minhash import MinHashConfig, shingle_hashes
from data_pipeline.text_units import UnitsConfig, words
from framework.base.errors import ConfigError

FIXTURE = Path(__file__).parents[1] / "fixtures" / "multilingual" / "texts.jsonl"
ROWS = [json.loads(line) for line in FIXTURE.read_text(encoding="utf-8").splitlines()]
# Character names of the scripts written without spaces, as Unicode spells them (independent of the code's ranges).
_UNSPACED_NAMES = ("CJK UNIFIED IDEOGRAPH", "CJK COMPATIBILITY IDEOGRAPH", "HIRAGANA", "KATAKANA", "THAI CHARACTER",
                   "LAO ", "KHMER ", "MYANMAR ")


def _docs(lang: str, kind: str = "prose") -> list[str]:
    return [r["text"] for r in ROWS if r["lang"] == lang and r["kind"] == kind]


def _unspaced_base(ch: str) -> bool:
    return unicodedata.name(ch, "").startswith(_UNSPACED_NAMES) and not unicodedata.category(ch).startswith("M")


def test_units_are_whitespace_tokens_without_unspaced_scripts_and_characters_within_them() -> None:
    for lang in ("ko", "ru", "ar"):
        for text in _docs(lang):
            assert words(text) == text.split()
    english = "The quick brown fox -- don't panic! Café, naïve; 3.14 (x) “quoted”\n\ttabs"
    assert words(english) == english.split()
    for lang in ("zh", "ja", "th"):
        for text in _docs(lang) + (_docs(lang, "mixed") if lang != "th" else []):
            ws = words(text)
            # Every base character of those scripts is one unit of its own, its combining marks with it.
            singles = [w for w in ws if _unspaced_base(w[0])]
            assert all(len(w) == 1 or all(unicodedata.category(c).startswith("M") for c in w[1:]) for w in singles)
            assert len(singles) == sum(map(_unspaced_base, text))
            # Nothing is lost: the units are the text without its whitespace, in order.
            assert "".join(ws) == re.sub(r"\s+", "", text)
    assert words("安装Python包。然后运行 pip install。") == [
        "安", "装", "Python", "包", "。", "然", "后", "运", "行", "pip", "install", "。"]
    assert words("ภาษาไทยที่") == ["ภ", "า", "ษ", "า", "ไ", "ท", "ย", "ที่"]  # tone mark and vowel sign kept on ท


def test_docs_profile_keeps_clean_prose_in_every_language() -> None:
    names, cfg = resolve_filters(None, "docs"), FiltersConfig()
    for lang in ("zh", "ja", "th", "ko", "ru", "ar"):
        for kind in ("prose", "mixed"):
            docs = _docs(lang, kind)
            if not docs:
                continue
            kept = sum(len(out or "") for out, _ in (apply_filters(t, names, cfg) for t in docs))
            assert kept >= 0.95 * sum(map(len, docs)), (lang, kind)


def test_docs_rules_still_drop_blobs_in_chinese_text() -> None:
    """The word-length rule still measures the whitespace words of a page that is mostly them: a base64 blob with
    a Chinese caption is dropped, the caption's characters do not hide it."""
    rng = random.Random(3)
    blob = " ".join("".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")
                            for _ in range(76)) for _ in range(40))
    text = _docs("zh")[0][:60] + "\n" + blob
    assert apply_filters(text, ("docs",), FiltersConfig())[1] == "docs.mean_word_length"


@pytest.mark.parametrize("lang,kind", [("zh", "prose"), ("zh", "mixed"), ("ja", "prose"), ("ja", "mixed"),
                                       ("th", "prose")])
def test_near_copies_with_two_percent_of_characters_replaced_are_found(lang: str, kind: str) -> None:
    docs = _docs(lang, kind)
    n, found, wrong = len(docs), 0, 0
    for seed in range(3):
        rng = random.Random(seed)
        res = near_dedup(docs + [replace_letters(t, rng) for t in docs], MinHashConfig())
        removed = np.flatnonzero(~res.keep)
        found += sum(int(res.cluster[i] % n == i % n) for i in removed)
        wrong += sum(int(res.cluster[i] % n != i % n) for i in removed)
    assert found >= 0.95 * 3 * n, (found, 3 * n)
    assert wrong == 0


def test_distinct_documents_of_every_language_are_not_near_duplicates() -> None:
    texts = [r["text"] for r in ROWS]
    res = near_dedup(texts, MinHashConfig())
    assert res.keep.all(), [texts[i][:40] for i in np.flatnonzero(~res.keep)]


def test_shingles_see_each_unspaced_character_as_a_word() -> None:
    """The shingle hashes of mixed text equal those of the same text with every such character written as a
    separate word and East Asian punctuation as a space (what the ASCII word rule does with '.')."""
    text = "安装Python包。然后运行「pip install」命令。ภาษาไทย"
    spaced = "安 装 Python 包 然 后 运 行 pip install 命 令 ภ า ษ า ไ ท ย"
    assert np.array_equal(shingle_hashes([text], 5)[0], shingle_hashes([spaced], 5)[0])
    english = "Near duplicates are found by word shingles. Café naïve!"
    assert text_units.shingle_text(english) is english


def _split_chars(run: str) -> list[str]:
    """A stand-in segmenter: pairs of characters."""
    return [run[i:i + 2] for i in range(0, len(run), 2)]


def test_a_named_segmenter_cuts_the_runs_of_its_script_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    units = UnitsConfig(segmenters={"cjk": "test_text_units:_split_chars"})
    units.validate()
    assert words("安装软件 Python包。ภาษา", units) == ["安装", "软件", "Python", "包", "。", "ภ", "า", "ษ", "า"]
    with pytest.raises(ConfigError, match="groups are"):
        UnitsConfig(segmenters={"chinese": "jieba"}).validate()
    with pytest.raises(ConfigError, match="pip install no_such_segmenter"):
        UnitsConfig(segmenters={"thai": "no_such_segmenter:cut"}).validate()


def test_the_units_setting_is_part_of_the_ingest_stamp(tmp_path: Path) -> None:
    src = [SourceConfig(name="zh", path=str(tmp_path), profile="docs")]
    plain = BuildConfig(output_dir=str(tmp_path), sources=src)
    seg = BuildConfig(output_dir=str(tmp_path), sources=src,
                      filters=FiltersConfig(units=UnitsConfig(segmenters={"cjk": "jieba"})))
    assert stage_keys(plain)["ingest/zh"] != stage_keys(seg)["ingest/zh"]
